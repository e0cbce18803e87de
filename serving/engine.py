"""The engines a stored model can run on, behind one small interface (`Engine`).

ONNX Runtime runs every variant, and the GPU ones through its TensorRT and CUDA providers;
OpenVINO runs the CPU variants made for it: the FP32 export as it is and NNCF's INT8 graphs,
whose QDQ placement only OpenVINO turns into int8 kernels. Which is faster depends on the CPU
(OpenVINO ran MiniLM 2.2 × ORT on an AVX512-VNNI host, 1.16 × on an AVX2-only one), so the
pipeline times each variant on its own engine and records the engine with the model
(`ENGINE_LABEL`); the service opens each model as it was measured.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import onnxruntime as ort

EngineName = Literal["onnxruntime", "openvino", "openvino-bf16"]
ENGINE_LABEL = "runtime"  # the model-store label that names a model's engine

# Preferred order; only those the installed onnxruntime build offers are used.
PROVIDER_PREFERENCE = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "CPUExecutionProvider",
)


def available_providers() -> list[str]:
    installed = set(ort.get_available_providers())
    return [p for p in PROVIDER_PREFERENCE if p in installed]


def default_intra_op_threads(processes: int = 1) -> int:
    """The CPUs this process is given, shared by `processes` processes that each hold a session;
    OPTISERVE_ORT_THREADS overrides."""
    configured = os.environ.get("OPTISERVE_ORT_THREADS")
    if configured:
        return int(configured)
    return max(1, len(os.sched_getaffinity(0)) // processes)


def spin_from_environment() -> bool:
    """Busy-waiting intra-op threads: off unless OPTISERVE_ORT_SPIN=1 (see EngineSettings.spin)."""
    return os.environ.get("OPTISERVE_ORT_SPIN", "0") == "1"


@dataclass(frozen=True)
class EngineSettings:
    """`spin`: let idle intra-op threads busy-wait for the next run. Off by default: the model
    worker shares a few cores with the front's decode threads and the other model worker, and
    spinning threads took their CPU. Measured with `python -m loadtest` on 2 cores, /classify
    with spinning off served 27-37 % more requests/s at concurrency 1 and 8 (BENCHMARKS.md)."""

    intra_op_threads: int
    inter_op_threads: int = 1
    providers: tuple[str, ...] = ()
    spin: bool = False

    @classmethod
    def from_environment(cls, processes: int = 1) -> EngineSettings:
        return cls(
            intra_op_threads=default_intra_op_threads(processes),
            providers=tuple(available_providers()),
            spin=spin_from_environment(),
        )


class Engine(Protocol):
    input_names: list[str]
    output_names: list[str]
    length_multiple: int  # text batches are padded to a multiple of this many tokens

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class OnnxEngine:
    """One InferenceSession with named inputs; thread-safe for concurrent `run` calls."""

    length_multiple = 1  # a shape it has not seen costs it about 3 %: no padding pays for that

    def __init__(self, model_path: Path, settings: EngineSettings) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.intra_op_threads
        options.inter_op_num_threads = settings.inter_op_threads
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.spin else "0")
        # No memory pattern: it plans a block per input shape it sees, and served traffic brings
        # every batch size up to the cap. EfficientNet-Lite0 after 40 batches of 1-64 rows: 833
        # MiB over its start against 937 (the same 705 after growing sizes alone); 64-row batches
        # 398 against 394 ms; /classify swept to 64 clients: the worker 1 196 and 1 224 MiB after
        # it against 1 279 and 1 298, at the same req/s (2 AVX2 cores, alternated; BENCHMARKS.md).
        options.enable_mem_pattern = False
        options.log_severity_level = 3  # errors only: graph-cleanup notices would flood service logs
        self.session = ort.InferenceSession(
            str(model_path),
            sess_options=options,
            providers=list(settings.providers) or available_providers(),
        )
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, outputs, strict=True))


class OpenVinoEngine:
    """One model compiled by OpenVINO for the CPU from its ONNX file; thread-safe (an infer
    request per calling thread). Precision stays f32 unless the graph itself is quantized:
    OpenVINO would otherwise run bf16 on CPUs that have it, which is a different model from
    the one the pipeline measured."""

    precision = "f32"
    # Its CPU plugin prepares kernels for each new input shape and keeps them: a (rows, tokens)
    # shape it has not seen ran 1.45 × slower (median) on MiniLM-L6 INT8 on AMX, and texts of
    # every length make more shapes than it keeps. Padded to multiples of 8 tokens, random batches
    # of real sentences ran at 605 rows/s instead of 484 over 400 calls and 658 instead of 627
    # over 1 200 (call p99 54 against 63 ms); ONNX Runtime gained nothing from it (365 against 374).
    length_multiple = 8
    # Its threads are not pinned to cores: the event loop and the clients share them, and a pinned
    # thread cannot move off a core the loop holds. /embed at 64 connections, 2 cores (wrk, five
    # alternated rounds): 551 against 523 req/s pinned; /classify unchanged (BENCHMARKS.md).

    def __init__(self, model_path: Path, settings: EngineSettings) -> None:
        import openvino as ov
        import openvino.properties as props
        import openvino.properties.hint as hints

        config = {
            props.inference_num_threads: settings.intra_op_threads,
            hints.performance_mode: hints.PerformanceMode.LATENCY,
            hints.inference_precision: getattr(ov.Type, self.precision),
            props.num_streams: 1,
            hints.enable_cpu_pinning: False,
        }
        self.compiled = ov.Core().compile_model(str(model_path), "CPU", config)
        self.input_names = [port.any_name for port in self.compiled.inputs]
        self.output_names = [port.any_name for port in self.compiled.outputs]
        self._requests = threading.local()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self.compiled.create_infer_request()
        results = request.infer({name: feeds[name] for name in self.input_names})
        return {name: results[port] for name, port in zip(self.output_names, self.compiled.outputs, strict=True)}


class OpenVinoBf16Engine(OpenVinoEngine):
    """OpenVINO computing in bf16 where the CPU has bf16 instructions (AMX, AVX512_BF16): a model
    of its own, measured and gated as the `openvino-bf16` variant (pipeline/variants/openvino.py).
    On a CPU without them OpenVINO computes in f32."""

    precision = "bf16"


ENGINES: dict[str, type[Engine]] = {
    "onnxruntime": OnnxEngine,
    "openvino": OpenVinoEngine,
    "openvino-bf16": OpenVinoBf16Engine,
}


def open_engine(name: str, model_path: Path, settings: EngineSettings) -> Engine:
    """The named engine over a model file; an engine this installation lacks is named as such."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return ENGINES[name](model_path, settings)
