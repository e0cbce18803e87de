"""The served variant's working memory per batch size: what a worker holds beyond its weights.

ONNX Runtime's arena keeps the largest batch's activations for the session's life, and the
service warms every engine up to its row cap before it takes traffic: the cap sets a worker's
memory as well as its speed (EfficientNet-Lite0 on 2 AVX2 cores: about 780 MiB after batches
of up to 64 rows, 200 MiB up to 16; MiniLM INT8 25 MiB at 64 rows). Measured in a fresh process,
as a worker would start: in the build's own process, memory that torch and the datasets freed is
still resident, and an engine allocating into it adds nothing to the process's resident size.
And measured after batches of mixed sizes, as traffic brings them: the arena fragments, and
EfficientNet-Lite0 held 705 MiB after one call at each of 1-64 rows, 812 after 8 more of random
sizes, 832 after 40 and 838 after 120.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from serving.engine import EngineSettings
from serving.model_spec import ModelSpec

MIXED_CALLS = 8  # batches of random sizes after each size's first call


def working_memory(
    path: Path, spec: ModelSpec, settings: EngineSettings, engine: str, rows: Sequence, sizes: Sequence[int]
) -> dict[int, float]:
    """MiB a fresh process running `path` through the serving runtime grew by, from before its
    first call to after traffic up to each size, smallest first: a call at that size, then
    `MIXED_CALLS` of random sizes up to it, as served traffic brings."""
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
    grown, mixed = {}, random.Random(0)
    for size in sizes:
        for rows_now in (size, *(mixed.randint(1, size) for _ in range(MIXED_CALLS))):
            run(rows_now)
        grown[size] = max(0, process.memory_info().rss - before) / 2**20
    return grown


if __name__ == "__main__":
    print(json.dumps(_measure(sys.stdin.buffer.read())))
