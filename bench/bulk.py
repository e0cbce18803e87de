"""`make bench-bulk` / `python -m bench.bulk`: a bulk embedding task beside interactive traffic.

Against one `bentoml serve` of the manifest's models, with interactive /embed requests (one
sentence each) at `--concurrency` throughout:

1. unloaded: the interactive requests alone for `--unloaded-s` → p50/p99;
2. bulk: a BentoML task (`/embed_bulk/submit`) embeds `--texts` corpus sentences while the
   interactive load goes on; p50/p99 of the interactive requests that finished while the task
   ran, and the task's time and texts/s;
3. unloaded again, so that drift of the shared machine shows.

Target: interactive p99 during the task ≤ 1.5 × the first unloaded p99. A table, JSON and a
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

    parser = phased_parser("python -m bench.bulk", __doc__, "interactive clients")
    parser.add_argument("--texts", type=int, default=5000, help="texts in the bulk task")
    parser.add_argument("--encoding", choices=("float", "base64"), default="float", help="the bulk answer's format")
    return parser.parse_args(argv)


async def interactive_beside_bulk(
    base: str, interactive: list, bulk_texts: list[str], args: argparse.Namespace
) -> dict:
    """The three phases on one event loop: the load never pauses between them."""
    import httpx

    from loadtest.client import Pool
    from loadtest.generator import closed_loop
    from loadtest.stats import Recorder

    recorder, stop, pool = Recorder(), asyncio.Event(), Pool(base + "/embed", timeout=30)
    clients = args.concurrency
    load = asyncio.create_task(closed_loop(pool, interactive, concurrency=clients, stop=stop, recorder=recorder))
    marks = {"start": time.perf_counter()}
    await asyncio.sleep(args.unloaded_s)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        marks["bulk_submitted"] = time.perf_counter()
        submitted = await client.post(
            "/embed_bulk/submit", json={"texts": bulk_texts, "truncate": True, "encoding_format": args.encoding}
        )
        submitted.raise_for_status()
        task_id = submitted.json()["task_id"]
        while (status := (await client.get("/embed_bulk/status", params={"task_id": task_id})).json()["status"]) in (
            "pending",
            "in_progress",
        ):
            await asyncio.sleep(0.1)
        marks["bulk_done"] = time.perf_counter()
        result = await client.get("/embed_bulk/get", params={"task_id": task_id})
    await asyncio.sleep(args.unloaded_s)
    marks["end"] = time.perf_counter()
    stop.set()
    await load
    pool.close()
    embedded = len(result.json().get("embeddings", [])) if result.status_code == 200 else 0
    return {"marks": marks, "outcomes": recorder, "task_status": status, "embedded": embedded}


def summarize(run: dict, texts: int) -> dict[str, Any]:
    from bench.serving import phases_around

    marks = run["marks"]
    bulk_s = marks["bulk_done"] - marks["bulk_submitted"]
    phases, target = phases_around(run["outcomes"], marks, "bulk", ("bulk_submitted", "bulk_done"), P99_WITHIN)
    target["met"] = target["met"] and run["embedded"] == texts  # the task must finish too
    return {
        "bulk": {"texts": texts, "status": run["task_status"], "embedded": run["embedded"], "seconds": bulk_s},
        "bulk_texts_per_s": texts / bulk_s,
        "phases": phases,
        "target": target,
    }


def print_summary(results: dict[str, Any]) -> None:
    from rich.console import Console

    from bench.serving import phase_table, verdict_text

    title = f"interactive /embed at concurrency {results['settings']['concurrency']} beside a bulk task"
    table = phase_table(title, results["phases"])
    console = Console(width=160)
    console.print(table)
    bulk = results["bulk"]
    console.print(
        f"bulk task: {bulk['texts']} texts, {bulk['status']}, {bulk['embedded']} embeddings in {bulk['seconds']:.1f} s"
        f" ({results['bulk_texts_per_s']:.0f} texts/s)"
    )
    console.print(f"p99 during the task vs unloaded: {verdict_text(results['target'])}")


def write_plot(run: dict, results: dict[str, Any], path: Path) -> None:
    """Each interactive request's latency against time, the bulk task's span shaded."""
    from bench.serving import latency_timeline
    from loadtest.report import save_figure

    marks = run["marks"]
    reference = results["phases"]["unloaded_before"]["latency_ms"]["p99"]
    figure = latency_timeline(
        run,
        [(marks["bulk_submitted"], marks["bulk_done"])],
        "bulk task",
        (P99_WITHIN * reference, f"{P99_WITHIN} × unloaded p99"),
        (
            "interactive /embed latency (ms)",
            f"a bulk task of {results['bulk']['texts']} texts beside interactive traffic",
        ),
    )
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    from bench.serving import MODELS, Samples, served_run
    from loadtest.generator import post_requests
    from sample_inputs import corpus_sentences

    samples = Samples()
    held_back = set(samples.texts)
    corpus = [t for t in corpus_sentences() if t not in held_back]
    bulk_texts = [corpus[i % len(corpus)] for i in range(args.texts)]
    text = MODELS["text"]
    with served_run(args, "bulk") as served:
        url = served.url
        print(f"interactive {text.path} at concurrency {args.concurrency}, then a bulk task of {args.texts} texts …")
        requests = post_requests(url + text.path, text.payloads(samples))
        run = uvloop.run(interactive_beside_bulk(url, requests, bulk_texts, args))
    results = served.record | summarize(run, args.texts)
    print_summary(results)
    served.finish(results, lambda path: write_plot(run, results, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
