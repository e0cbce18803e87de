"""The CPU's instruction sets that decide which kernels run: every speed figure is recorded with
them, because the same model is 2× apart between an AVX2 host and a VNNI or AMX one."""

from __future__ import annotations

from functools import cache
from pathlib import Path

# /proc/cpuinfo names, in the order they raise int8 and bf16 throughput on x86.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx_vnni", "avx512_vnni", "amx_bf16", "amx_int8")


@cache
def isa_flags() -> tuple[str, ...]:
    """Which of ISA_FLAGS this CPU has (none where /proc/cpuinfo is missing, e.g. macOS)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return tuple(flag for flag in ISA_FLAGS if flag in flags)


def has_vnni() -> bool:
    """Without VNNI, x86 int8 kernels can saturate u8×s8 products; ORT then advises 7-bit weights."""
    return any("vnni" in flag for flag in isa_flags())
