"""Worker-process hygiene: full garbage collections rare under load, young ones as before."""

from __future__ import annotations

import json
import subprocess
import sys

from serving.process import FULL_COLLECTION_EVERY

# A worker's life in miniature: requests allocate small cyclic objects, a window of the recent
# ones stays alive for a while (as BentoML's timers do), and each collection is counted.
CHURN = """
import collections, gc, json, sys
from serving.process import freeze_startup_heap
if sys.argv[1] == "frozen":
    freeze_startup_heap()
counts = collections.Counter()
gc.callbacks.append(lambda phase, info: counts.update([info["generation"]]) if phase == "stop" else None)
alive = collections.deque(maxlen=50_000)
for n in range(600_000):
    request = {"n": n, "headers": [("a", "b")]}
    request["self"] = request
    alive.append(request)
print(json.dumps(counts))
"""


def collections_per_generation(mode: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_after_start_up_full_collections_come_a_tenth_as_often_and_young_ones_as_before() -> None:
    default, frozen = collections_per_generation("default"), collections_per_generation("frozen")

    assert int(default["2"]) >= 5, default
    assert int(frozen.get("2", 0)) <= int(default["2"]) * 10 // FULL_COLLECTION_EVERY + 1, (default, frozen)
    assert abs(int(frozen["0"]) - int(default["0"])) <= int(default["0"]) // 10, (default, frozen)
