"""The served variant's working memory per batch size: what a worker holds beyond its weights.

ONNX Runtime's arena keeps the largest batch's activations for the session's life, and the
service warms every engine up to its row cap before it takes traffic: the cap sets a worker's
memory as well as its speed (EfficientNet-Lite0 on 2 AVX2 cores: about 700 MiB after 64-row
batches, 170 MiB after 16-row ones; MiniLM INT8 25 MiB at 64 rows). Measured in a fresh process,
as a worker would start: in the build's own process, memory that torch and the datasets freed is
still resident, and an engine allocating into it adds nothing to the process's resident size.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from serving.engine import EngineSettings
from serving.model_spec import ModelSpec


def working_memory(
    path: Path, spec: ModelSpec, settings: EngineSettings, engine: str, rows: Sequence, sizes: Sequence[int]
) -> dict[int, float]:
    """MiB a fresh process running `path` through the serving runtime grew by, from before its
    first call to after its first call at each size, smallest first."""
    job = pickle.dumps((path, spec, settings, engine, list(rows), sorted(sizes)))
    command = [sys.executable, "-m", "pipeline.working_memory"]
    done = subprocess.run(command, input=job, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the working memory of {path.name} failed:\n{done.stderr.decode()[-2000:]}")
    return {int(size): mib for size, mib in json.loads(done.stdout.decode().splitlines()[-1]).items()}


def _measure(job: bytes) -> dict[int, float]:
    import psutil

    from pipeline.profile import runtime_runner, sampler
    from serving.model_runtime import onnx_runtime

    path, spec, settings, engine, rows, sizes = pickle.loads(job)
    run = runtime_runner(onnx_runtime(path, spec, settings, engine), sampler(rows))
    process = psutil.Process()
    before = process.memory_info().rss
    grown = {}
    for size in sizes:
        run(size)
        grown[size] = max(0, process.memory_info().rss - before) / 2**20
    return grown


if __name__ == "__main__":
    print(json.dumps(_measure(sys.stdin.buffer.read())))
