"""Worker-process hygiene: full garbage collections rare under load, the middle generation small."""

from __future__ import annotations

import json
import subprocess
import sys

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
