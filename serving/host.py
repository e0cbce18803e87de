"""The machine a model was profiled on, how busy other work kept it, and whether it is this one.

A profile's figures, and the variant and batching chosen from them, hold on the machine that
measured them: the same text model ran OpenVINO's INT8 at 4.55 × ONNX Runtime's FP32 on an AMX
host and at 0.87 × on an AVX2 one (batch 32 × 128 tokens), where ONNX Runtime's own INT8 was the
fastest. So the selected model records where it was profiled; the pipeline builds again rather
than reuse it on another machine, and the service warns when it serves it on one, or serves a
profile taken beside other work (pipeline/host_load.py measures it).
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from serving.cpu import cpu_name, isa_flags
from serving.engine import available_providers

PROFILED_ON = "profiled_on"  # the selected model's metadata keys
PROFILE_LOAD = "profile_load"
# Other work on more than this share of the cores slows a profile by more than selection's 5 %
# noise margin (pipeline/build.py): its batching is then chosen from inflated latencies.
BUSY_SHARE = 0.1


class OtherLoad(BaseModel):
    """Other work's share of the machine over a stretch of the pipeline's time."""

    seconds: float
    cores: int
    busy_cores: float  # mean cores other processes kept busy

    @property
    def too_busy(self) -> bool:
        return self.busy_cores > BUSY_SHARE * self.cores

    def describe(self) -> str:
        return f"other processes kept {self.busy_cores:.2f} of the machine's {self.cores} cores busy"


class Host(BaseModel):
    cpu: str
    cores: int  # the cores this process may use, which the engines' threads are sized to
    isa: list[str]  # serving.cpu.ISA_FLAGS present
    providers: list[str]  # ONNX Runtime's execution providers, in preference order

    def differences(self, other: Host) -> list[str]:
        """What differs from `other`, in words; empty when the two are alike."""
        return [
            f"{field} {getattr(other, field)} → {getattr(self, field)}"
            for field in Host.model_fields
            if getattr(self, field) != getattr(other, field)
        ]


def this_host() -> Host:
    return Host(
        cpu=cpu_name(),
        cores=len(os.sched_getaffinity(0)),
        isa=list(isa_flags()),
        providers=available_providers(),
    )


def profiled_elsewhere(metadata: dict) -> list[str] | None:
    """How this machine differs from the one a selected model was profiled on; None where the
    model does not say (models stored before it was recorded, variants not selected)."""
    if PROFILED_ON not in metadata:
        return None
    return this_host().differences(Host.model_validate(metadata[PROFILED_ON]))


def profile_doubts(metadata: dict) -> list[str]:
    """Why a selected model's variant and batching may not suit this machine: it was profiled on
    another one, or beside other work that inflated its latencies."""
    doubts = []
    if moved := profiled_elsewhere(metadata):
        doubts.append(f"it was profiled on another machine ({'; '.join(moved)})")
    if PROFILE_LOAD in metadata and (load := OtherLoad.model_validate(metadata[PROFILE_LOAD])).too_busy:
        doubts.append(f"it was profiled while {load.describe()}")
    return doubts
