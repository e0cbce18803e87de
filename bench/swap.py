"""`make bench-swap` / `python -m bench.swap`: hot swaps of a served model under load.

Against one `bentoml serve` of the manifest's models (a copy of the manifest, so the aliases
beside it are the bench's own), with requests to the endpoint at `--concurrency` throughout:

1. steady: the requests alone for `--steady-s` → p50/p99;
2. each of `--swaps` swaps, alternately `python -m pipeline promote --to` and `rollback`: from
   the command until the service logs the swap, plus `DRAIN_S` (the old model's last requests);
   then `--steady-s` again before the next one.

Targets (#12): no failed request, and p99 during each swap ≤ 2 × the p99 of the steady phase
just before it (the host is shared: it drifts between phases). A table, JSON and a latency
timeline plot go to reports/bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
P99_WITHIN = 2.0  # × the steady p99
DRAIN_S = 1.0  # after the swap: the requests still on the old model finish
POLL_S = 0.1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, help="serve this manifest's models (default: build both recipes)")
    parser.add_argument("--model", choices=("image", "text"), default="text", help="whose endpoint swaps")
    parser.add_argument("--to", help="the version to promote (default: the newest other intact one in the store)")
    parser.add_argument("--swaps", type=int, default=2, help="promote, rollback, promote, …")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--steady-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench")
    return parser.parse_args(argv)


def other_version(tag: str) -> str:
    """The newest other intact version of the tag's model, of the same variant where there is one
    (a rebuild: the swap, not a faster or slower model, is what the figures then show)."""
    import bentoml

    from serving.artifacts import mismatched_files

    served = bentoml.models.get(tag)
    others = [m for m in bentoml.models.list(served.tag.name) if m.tag != served.tag and not mismatched_files(m)]
    if not others:
        raise SystemExit(f"no other intact version of {served.tag.name} in the store to swap to: pass --to")
    variant = served.info.labels.get("variant")
    return str(max(others, key=lambda m: (m.info.labels.get("variant") == variant, m.info.creation_time)).tag)


async def swaps_under_load(url: str, path: str, requests: list, moves: list, swaps: SwapLines, args) -> dict:
    """The load never pauses. Swap i runs the command `moves[i % 2]` in a process of its own, as a
    user would, and ends with the service's log line of the swap: the client's loop neither parses
    /metrics nor hashes model files meanwhile, and the server serves no scrape."""
    from loadtest.client import Pool
    from loadtest.generator import closed_loop
    from loadtest.stats import Recorder

    recorder, stop, pool = Recorder(), asyncio.Event(), Pool(url + path, timeout=30)
    load = asyncio.create_task(closed_loop(pool, requests, concurrency=args.concurrency, stop=stop, recorder=recorder))
    marks = {"start": time.perf_counter()}
    await asyncio.sleep(args.steady_s)
    for index in range(args.swaps):
        seen = swaps.count()
        marks[f"swap{index}"] = time.perf_counter()
        command = await asyncio.create_subprocess_exec(*moves[index % 2], cwd=REPO)
        if await command.wait() != 0:
            raise SystemExit(f"{' '.join(moves[index % 2])} failed")
        while swaps.count() == seen:
            await asyncio.sleep(POLL_S)
        marks[f"swap{index}_done"] = time.perf_counter()
        await asyncio.sleep(args.steady_s)
    marks["end"] = time.perf_counter()
    stop.set()
    await load
    pool.close()
    return {"marks": marks, "outcomes": recorder}


class SwapLines:
    """Swaps the server has logged so far, reading only what the log gained since the last look.
    `marker` is serving.lifecycle's SWAPPED, imported before the load starts: imported on the
    load generator's loop, serving's imports (onnxruntime among them) stalled it for 0.6 s."""

    def __init__(self, log: Path, marker: str) -> None:
        self._log, self._marker, self._offset, self._count = log, marker.encode(), 0, 0

    def count(self) -> int:
        with self._log.open("rb") as handle:
            handle.seek(self._offset)
            gained = handle.read()
        whole = gained.rfind(b"\n") + 1
        self._offset += whole
        self._count += gained[:whole].count(self._marker)
        return self._count


def summarize(run: dict, swaps: int) -> dict[str, Any]:
    from bench.serving import phase_figures

    marks, recorder = run["marks"], run["outcomes"]

    def phase(start: float, end: float) -> dict[str, Any]:
        return phase_figures(recorder, start, end)

    phases = {"steady": phase(marks["start"], marks["swap0"])}
    ratios = []
    for index in range(swaps):
        before = phases["steady" if index == 0 else f"after swap {index}"]
        done = marks[f"swap{index}_done"]
        during = phase(marks[f"swap{index}"], done + DRAIN_S)
        ratios.append(during["latency_ms"]["p99"] / before["latency_ms"]["p99"])
        phases[f"swap {index + 1}"] = during | {"swap_s": done - marks[f"swap{index}"], "p99_vs_before": ratios[-1]}
        end = marks[f"swap{index + 1}"] if index + 1 < swaps else marks["end"]
        phases[f"after swap {index + 1}"] = phase(done + DRAIN_S, end)
    failed = sum(p["failed"] for p in phases.values())
    return {
        "phases": phases,
        "target": {
            "p99_during_swap_vs_before": max(ratios),
            "failed": failed,
            "target": f"<= {P99_WITHIN} and 0 failed",
            "met": max(ratios) <= P99_WITHIN and failed == 0,
        },
    }


def print_summary(results: dict[str, Any], endpoint: str) -> None:
    from rich.console import Console

    from bench.serving import number_text, phase_table, verdict_text

    concurrency = results["settings"]["concurrency"]
    title = f"{endpoint} at concurrency {concurrency}: {results['from']} ⇄ {results['to']}"
    table = phase_table(
        title,
        results["phases"],
        {
            "swap s": lambda phase: number_text(phase.get("swap_s"), ".2f"),
            "p99 / before": lambda phase: number_text(phase.get("p99_vs_before"), ".2f"),
            "errors": lambda phase: ", ".join(f"{status} × {count}" for status, count in phase["errors"].items()),
        },
    )
    console = Console(width=160)
    console.print(table)
    console.print(f"p99 during a swap vs just before it, failures: {verdict_text(results['target'])}")


def write_plot(run: dict, results: dict[str, Any], path: Path) -> None:
    """Each request's latency against time, the swaps shaded."""
    from bench.serving import latency_timeline
    from loadtest.report import save_figure

    marks = run["marks"]
    spans = [(marks[f"swap{i}"], marks[f"swap{i}_done"] + DRAIN_S) for i in range(results["settings"]["swaps"])]
    reference = results["phases"]["steady"]["latency_ms"]["p99"]
    line = (P99_WITHIN * reference, f"{P99_WITHIN} × first steady p99")
    save_figure(latency_timeline(run, spans, "swap", line, ("latency (ms)", "hot swaps under load")), path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    from bench.serving import MODELS, Samples, prepare_store, served_run
    from loadtest.generator import post_requests
    from serving.lifecycle import SWAPPED
    from serving.manifest import read_manifest

    model = MODELS[args.model]
    own = Path(tempfile.mkdtemp(prefix="optiserve-bench-swap-")) / "serving-manifest.json"
    shutil.copy(prepare_store(args), own)  # the aliases go beside the copy, never beside the user's manifest
    args.manifest = own
    route = model.route(read_manifest(own))
    target = args.to or other_version(route.tag)
    where = ["--alias", route.alias, "--manifest", str(own)]
    moves = [
        [sys.executable, "-m", "pipeline", "promote", target, *where],
        [sys.executable, "-m", "pipeline", "rollback", route.recipe, *where],
    ]
    with served_run(args, "swap") as served:
        print(f"{model.path} at concurrency {args.concurrency}; {args.swaps} swaps {route.tag} ⇄ {target} …")
        requests = post_requests(served.url + model.path, model.payloads(Samples()))
        swaps = SwapLines(served.log, SWAPPED)
        run = uvloop.run(swaps_under_load(served.url, model.path, requests, moves, swaps, args))
    results = served.record | {"from": route.tag, "to": target} | summarize(run, args.swaps)
    print_summary(results, model.path)
    served.finish(results, lambda plot: write_plot(run, results, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
