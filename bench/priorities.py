"""`make bench-priorities` / `python -m bench.priorities`: normal requests beside a flood of low-priority ones.

Against one `bentoml serve` of the manifest's models, with normal /embed requests (one sentence
each) at `--concurrency` throughout:

1. unloaded: the normal requests alone for `--unloaded-s` → p50/p99;
2. flood: wrk sends low-priority requests (`?priority=low`, the same sentences) on
   `--flood-connections` connections for `--flood-s`, as fast as it is answered, refusals
   included; p50/p99 of the normal requests that finished meanwhile, and the flood's answers
   (`--flood-priority normal` sends the flood at normal priority, for comparison);
3. unloaded again, so that drift of the shared machine shows.

Target (#13): normal p99 during the flood ≤ 1.5 × the first unloaded p99. A table, JSON and a
latency timeline plot go to reports/bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
P99_WITHIN = 1.5  # × the unloaded p99


def parse_args(argv: list[str]) -> argparse.Namespace:
    from bench.serving import phased_parser

    parser = phased_parser("python -m bench.priorities", __doc__, "normal clients")
    parser.add_argument("--flood-connections", type=int, default=32, help="wrk's connections of low-priority requests")
    parser.add_argument("--flood-s", type=float, default=20.0)
    parser.add_argument("--flood-priority", choices=("low", "normal"), default="low")
    return parser.parse_args(argv)


async def normal_beside_flood(url: str, normal: list, flood: list, args: argparse.Namespace) -> dict:
    """The three phases on one event loop, wrk in a thread: the normal load never pauses."""
    from bench.wrk import run_wrk
    from loadtest.client import Pool
    from loadtest.generator import closed_loop
    from loadtest.stats import Recorder

    recorder, stop, pool = Recorder(), asyncio.Event(), Pool(url, timeout=30)
    load = asyncio.create_task(closed_loop(pool, normal, concurrency=args.concurrency, stop=stop, recorder=recorder))
    marks = {"start": time.perf_counter()}
    await asyncio.sleep(args.unloaded_s)
    marks["flood_start"] = time.perf_counter()
    flooded = f"{url}?priority={args.flood_priority}"
    wrk = await asyncio.to_thread(run_wrk, flooded, flood, connections=args.flood_connections, seconds=args.flood_s)
    marks["flood_end"] = time.perf_counter()
    await asyncio.sleep(args.unloaded_s)
    marks["end"] = time.perf_counter()
    stop.set()
    await load
    pool.close()
    return {"marks": marks, "outcomes": recorder, "wrk": wrk}


def summarize(run: dict) -> dict[str, Any]:
    from bench.serving import phases_around

    wrk = run["wrk"]
    phases, target = phases_around(run["outcomes"], run["marks"], "flood", ("flood_start", "flood_end"), P99_WITHIN)
    return {
        "flood": {
            "answers_per_s": wrk.requests / wrk.seconds,
            "served_per_s": wrk.throughput,  # answers below 400
            "refused_share": wrk.errors["status"] / max(1, wrk.requests),
        },
        "phases": phases,
        "target": target,
    }


def print_summary(results: dict[str, Any]) -> None:
    from rich.console import Console

    from bench.serving import phase_table, verdict_text

    settings = results["settings"]
    flood_priority = settings["flood_priority"]
    title = f"normal /embed at concurrency {settings['concurrency']} beside {flood_priority}-priority requests"
    console = Console(width=160)
    console.print(phase_table(title, results["phases"]))
    flood = results["flood"]
    console.print(
        f"flood: {flood['answers_per_s']:.0f} answers/s, {flood['served_per_s']:.0f} served/s, "
        f"{flood['refused_share']:.0%} refused"
    )
    console.print(f"normal p99 during the flood vs unloaded: {verdict_text(results['target'])}")


def write_plot(run: dict, results: dict[str, Any], path: Path) -> None:
    from bench.serving import latency_timeline
    from loadtest.report import save_figure

    marks = run["marks"]
    reference = results["phases"]["unloaded_before"]["latency_ms"]["p99"]
    figure = latency_timeline(
        run,
        [(marks["flood_start"], marks["flood_end"])],
        "low-priority flood",
        (P99_WITHIN * reference, f"{P99_WITHIN} × unloaded p99"),
        ("normal /embed latency (ms)", "normal requests beside a flood of low-priority ones"),
    )
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    from bench.serving import MODELS, Samples, served_run
    from loadtest.generator import post_requests

    samples = Samples()
    text = MODELS["text"]
    with served_run(args, "priorities") as served:
        url = served.url + text.path
        print(f"normal {text.path} at concurrency {args.concurrency}, then a low-priority flood …")
        payloads = text.payloads(samples)
        run = uvloop.run(normal_beside_flood(url, post_requests(url, payloads), payloads, args))
    results = served.record | summarize(run)
    print_summary(results)
    served.finish(results, lambda path: write_plot(run, results, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
