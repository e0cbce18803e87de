"""The machine a model was profiled on, and whether it is this one.

A profile's figures, and the variant and batching chosen from them, hold on the machine that
measured them: the same text model ran OpenVINO's INT8 at 4.55 × ONNX Runtime's FP32 on an AMX
host and at 0.87 × on an AVX2 one (batch 32 × 128 tokens), where ONNX Runtime's own INT8 was the
fastest. So the selected model records where it was profiled; the pipeline builds again rather
than reuse it on another machine, and the service warns when it serves it on one.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from serving.cpu import cpu_name, isa_flags
from serving.engine import available_providers

PROFILED_ON = "profiled_on"  # the selected model's metadata key


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
