"""The CPU's instruction sets that decide which kernels run: every speed figure is recorded with
them, because the same model is 2× apart between an AVX2 host and a VNNI or AMX one."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

# /proc/cpuinfo names, in the order they raise int8 and bf16 throughput on x86.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx_vnni", "avx512_vnni", "amx_bf16", "amx_int8")


def _cpuinfo(field: str) -> str | None:
    """The first value of a /proc/cpuinfo field (None where it is missing, e.g. macOS)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), None)


@cache
def isa_flags() -> tuple[str, ...]:
    """Which of ISA_FLAGS this CPU has."""
    flags = set((_cpuinfo("flags") or "").split())
    return tuple(flag for flag in ISA_FLAGS if flag in flags)


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def describe_cpu() -> str:
    """One line for reports: the CPU, the cores this process may use, the instruction sets."""
    isa = ", ".join(isa_flags()) or "none of AVX2/AVX-512/VNNI/AMX"
    return f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, ISA: {isa}"


def has_bf16() -> bool:
    """bf16 arithmetic in hardware (AMX or AVX512_BF16): without it OpenVINO computes bf16 models in f32."""
    return any("bf16" in flag for flag in isa_flags())


def has_vnni() -> bool:
    """Without VNNI, x86 int8 kernels can saturate u8×s8 products; ORT then advises 7-bit weights."""
    return any("vnni" in flag for flag in isa_flags())
