"""Worker-process hygiene: full garbage collections rare under load, the middle generation small,
new tasks run eagerly where Python has them, memory a burst freed given back once it is over."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from bench.processes import SERVE_PYTHON
from serving.process import TRIM_AFTER_GROWTH_MIB, QuietTrim, raise_open_files_limit

# A worker's life in miniature: requests allocate small cyclic objects, a window of the recent
# ones stays alive for a while (as requests in flight and BentoML's timers do), and each
# collection is counted, with how many young collections each middle one came after.
CHURN = """
import collections, gc, json, sys
from serving.process import freeze_startup_heap
if sys.argv[1] == "frozen":
    freeze_startup_heap()
counts, behind = collections.Counter(), []
def count(phase, info):
    if phase == "start" and info["generation"] == 1:
        behind.append(gc.get_count()[1])
    if phase == "stop":
        counts.update([str(info["generation"])])
gc.callbacks.append(count)
alive = collections.deque(maxlen=50_000)
for n in range(600_000):
    request = {"n": n, "headers": [("a", "b")]}
    request["self"] = request
    alive.append(request)
print(json.dumps({"counts": counts, "young_behind_middle": max(behind, default=0)}))
"""


def collections_per_generation(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_after_start_up_full_collections_are_rare_and_each_middle_one_follows_one_young_one() -> None:
    default, frozen = collections_per_generation("default"), collections_per_generation("frozen")

    assert int(default["counts"]["2"]) >= 5, default
    assert int(frozen["counts"].get("2", 0)) <= int(default["counts"]["2"]) // 5, (default, frozen)
    # CPython's middle collection walks ten young collections' survivors; ours one's.
    assert default["young_behind_middle"] > 5, default
    assert frozen["young_behind_middle"] == 1, frozen
    # Young collections smaller, so more of them.
    assert int(frozen["counts"]["0"]) > int(default["counts"]["0"]), (default, frozen)


# On the loop uvicorn serves with (uvloop): does a task created after the start-up hook run before
# create_task returns, as a request refused at the door must, to be answered in the turn that read it?
FIRST_STEP = """
import asyncio, json, platform, uvloop
from serving.process import run_new_tasks_eagerly
async def main():
    eager = run_new_tasks_eagerly()
    steps = []
    async def request():
        steps.append("door")
        await asyncio.sleep(0)
        steps.append("after a wait")
    task = asyncio.get_running_loop().create_task(request())
    before_return = list(steps)
    await task
    found = {"python": platform.python_version(), "eager": eager, "before_return": before_return, "steps": steps}
    print(json.dumps(found))
uvloop.run(main())
"""


def test_new_tasks_run_up_to_their_first_wait_at_once_on_python_3_12_and_later() -> None:
    # The interpreter that serves (OPTISERVE_SERVE_PYTHON: the container image's 3.13, say).
    out = subprocess.run([SERVE_PYTHON, "-c", FIRST_STEP], check=True, capture_output=True, text=True)
    found = json.loads(out.stdout)
    eager = tuple(int(part) for part in found["python"].split(".")[:2]) >= (3, 12)
    assert found["eager"] is eager
    assert found["before_return"] == (["door"] if eager else []), found
    assert found["steps"] == ["door", "after a wait"]


# A burst in a worker thread: 190 MiB of 64 kB buffers (below glibc's mmap threshold, so from the
# thread's arena), all freed but the last, which keeps the arena's top in place.
BURST = """
import json, threading, psutil
from serving.process import malloc_trim
process, kept = psutil.Process(), []
def burst():
    blocks = [bytearray(64 * 1024) for _ in range(3000)]
    kept.append(blocks[-1])
    del blocks
worker = threading.Thread(target=burst)
worker.start()
worker.join()
freed = process.memory_info().rss / 2**20
malloc_trim()(0)
print(json.dumps({"freed": freed, "trimmed": process.memory_info().rss / 2**20}))
"""


def test_a_trim_gives_back_what_a_burst_freed_and_glibc_kept() -> None:
    out = subprocess.run([SERVE_PYTHON, "-c", BURST], check=True, capture_output=True, text=True)
    found = json.loads(out.stdout)
    assert found["freed"] - found["trimmed"] >= 150, found


def test_the_worker_trims_once_memory_grew_and_its_threads_went_quiet() -> None:
    policy = QuietTrim(settled_mib=500)
    grown = 500 + TRIM_AFTER_GROWTH_MIB
    assert not policy.due(grown - 1, cpu_share=0.0)  # not grown enough
    assert not policy.due(grown + 100, cpu_share=1.6)  # grown, but in the middle of a burst
    assert policy.due(grown + 100, cpu_share=0.02)
    policy.trimmed(560)
    assert not policy.due(560 + TRIM_AFTER_GROWTH_MIB - 1, cpu_share=0.0)
    # Growth counts from the lowest point since the last trim.
    assert not policy.due(540, cpu_share=0.5)
    assert policy.due(540 + TRIM_AFTER_GROWTH_MIB, cpu_share=0.0)


def test_the_soft_limit_on_open_files_is_raised_to_the_hard_one_once() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        raised = raise_open_files_limit()
        after = resource.getrlimit(resource.RLIMIT_NOFILE)
        again = raise_open_files_limit()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert raised is not None and raised[0] == 256 and after == (raised[1], hard)
    assert raised[1] == hard or hard == resource.RLIM_INFINITY
    assert again is None
