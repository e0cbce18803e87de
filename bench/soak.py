"""`make soak` / `python -m bench.soak`: both endpoints at once, 70 % of the machine, for long.

Against one `bentoml serve` of the manifest's models: a short closed-loop sweep finds each
endpoint's knee alone (best throughput with p99 within the SLO); then Poisson arrivals on
/classify (one photo) and /embed (one sentence) at once, for `--duration-s`, each at `--load`
× its knee ÷ 2 (they share the machine: together they offer `--load` of it), while the
worker's resident memory is sampled every `--sample-s`. Targets: no errors; RSS
growth after the warm-up (the first window) below 5 %; per endpoint, p99 of the last window
≤ 1.2 × p99 of the first. A window is 5 minutes, or a sixth of a shorter run. A table, JSON and
a PNG of RSS and p99 over time go to reports/bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WINDOW_S = 300.0
RSS_GROWTH = 0.05
P99_DRIFT = 1.2


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, help="serve this manifest's models (default: build both recipes)")
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--load", type=float, default=0.7, help="arrival rate as a share of each knee")
    parser.add_argument("--sample-s", type=float, default=5.0, help="how often RSS is read")
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench")
    return parser.parse_args(argv)


def knee_throughput(url: str, payloads: list, slo_ms: float) -> float:
    from loadtest.sweep import SweepSettings, run_sweep

    settings = SweepSettings(
        url=url, levels=(1, 2, 4, 8, 16), slo_ms=slo_ms, warmup_s=1.0, window_s=2.0, max_windows=3, metrics_url=""
    )
    knee = run_sweep(settings, payloads, {"items": len(payloads)}).knee
    if knee is None:
        raise RuntimeError(f"{url}: no level within the SLO of {slo_ms} ms")
    return knee.throughput


async def soak(
    endpoints: dict[str, tuple[str, list, float]], supervisor: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Open-loop load on every endpoint at once; RSS samples beside it."""
    from bench.processes import worker_rss_mib
    from loadtest.client import Pool
    from loadtest.generator import open_loop, post_requests
    from loadtest.stats import Recorder

    stop = asyncio.Event()
    recorders, pools, loads = {}, [], []
    for name, (url, payloads, rate) in endpoints.items():
        recorders[name], pool = Recorder(), Pool(url, timeout=30)
        pools.append(pool)
        requests = post_requests(url, payloads)
        loads.append(
            open_loop(
                pool, requests, rate=rate, stop=stop, recorder=recorders[name], max_outstanding=256, seed=len(pools)
            )
        )
    started = time.perf_counter()
    running = [asyncio.create_task(load) for load in loads]
    rss: list[tuple[float, float]] = []
    while (elapsed := time.perf_counter() - started) < args.duration_s:
        rss.append((elapsed, await asyncio.to_thread(worker_rss_mib, supervisor)))
        await asyncio.sleep(min(args.sample_s, args.duration_s - elapsed))
    rss.append((time.perf_counter() - started, await asyncio.to_thread(worker_rss_mib, supervisor)))
    stop.set()
    await asyncio.gather(*running)
    for pool in pools:
        pool.close()
    return {"started": started, "recorders": recorders, "rss": rss}


def summarize(run: dict[str, Any], endpoints: dict[str, tuple[str, list, float]], duration_s: float) -> dict[str, Any]:
    from collections import Counter

    from loadtest.stats import latency_ms

    window = min(WINDOW_S, duration_s / 6)
    started = run["started"]
    results: dict[str, Any] = {"window_s": window, "endpoints": {}}
    for name, recorder in run["recorders"].items():
        first = recorder.between(started, started + window)
        last = recorder.between(started + duration_s - window, started + duration_s)
        first_p99 = latency_ms([o.latency for o in first if o.ok])
        last_p99 = latency_ms([o.latency for o in last if o.ok])
        statuses = Counter(o.status for o in recorder.outcomes)
        ratio = last_p99.p99 / first_p99.p99 if first_p99 and last_p99 else None
        results["endpoints"][name] = {
            "rate": endpoints[name][2],
            "requests": len(recorder.outcomes),
            "statuses": dict(sorted(statuses.items())),
            "first_window_p99_ms": first_p99.p99 if first_p99 else None,
            "last_window_p99_ms": last_p99.p99 if last_p99 else None,
            "p99_last_vs_first": {
                "ratio": ratio,
                "target": f"<= {P99_DRIFT}",
                "met": ratio is not None and ratio <= P99_DRIFT,
            },
            "errors": {"value": sum(n for s, n in statuses.items() if s != "200"), "target": 0},
        }
        results["endpoints"][name]["errors"]["met"] = results["endpoints"][name]["errors"]["value"] == 0
    after_warmup = [mib for t, mib in run["rss"] if t >= window]
    growth = (after_warmup[-1] - after_warmup[0]) / after_warmup[0] if len(after_warmup) > 1 else None
    results["rss_mib"] = run["rss"]
    results["rss_growth_after_warmup"] = {
        "ratio": growth,
        "target": f"< {RSS_GROWTH}",
        "met": growth is not None and growth < RSS_GROWTH,
    }
    results["met"] = results["rss_growth_after_warmup"]["met"] and all(
        e["p99_last_vs_first"]["met"] and e["errors"]["met"] for e in results["endpoints"].values()
    )
    return results


def print_summary(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from bench.serving import number_text, verdict_text

    table = Table(title=f"soak: {results['settings']['duration_s']:g} s at {results['settings']['load']:g} × the knee")
    for column in ("endpoint", "req/s", "requests", "statuses", "p99 first window ms", "p99 last window ms"):
        table.add_column(column, justify="right")
    for name, e in results["endpoints"].items():
        table.add_row(
            name,
            f"{e['rate']:.1f}",
            str(e["requests"]),
            " ".join(f"{k}:{v}" for k, v in e["statuses"].items()),
            number_text(e["first_window_p99_ms"]),
            number_text(e["last_window_p99_ms"]),
        )
    console = Console(width=160)
    console.print(table)
    rss = results["rss_mib"]
    console.print(f"worker RSS: {rss[0][1]:.0f} MiB at start, {rss[-1][1]:.0f} MiB at the end")
    for name, e in results["endpoints"].items():
        console.print(f"{name}: p99 last/first window: {verdict_text(e['p99_last_vs_first'])}")
        console.print(f"{name}: errors: {verdict_text(e['errors'])}")
    console.print(f"RSS growth after warm-up: {verdict_text(results['rss_growth_after_warmup'])}")


def write_plot(results: dict[str, Any], run: dict[str, Any], path: Path) -> None:
    from loadtest.report import pyplot, save_figure

    plt = pyplot()

    from loadtest.stats import latency_ms

    figure, (memory, latency) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    memory.plot([t for t, _ in results["rss_mib"]], [m for _, m in results["rss_mib"]], marker=".")
    memory.set_ylabel("worker RSS (MiB)")
    window = results["window_s"] / 5
    for name, recorder in run["recorders"].items():
        ends = [o.finished - run["started"] for o in recorder.outcomes]
        buckets: dict[int, list[float]] = {}
        for end, outcome in zip(ends, recorder.outcomes, strict=True):
            if outcome.ok:
                buckets.setdefault(int(end / window), []).append(outcome.latency)
        points = sorted((k * window, latency_ms(v).p99) for k, v in buckets.items())
        latency.plot([t for t, _ in points], [p for _, p in points], label=f"{name} p99")
    latency.set_ylabel("p99 per bucket (ms)")
    latency.set_xlabel("seconds")
    latency.legend()
    figure.suptitle("soak: memory and tail latency over time")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from bench.serving import MODELS, Samples, served_run

    samples = Samples()
    import uvloop

    with served_run(args, "soak") as served:
        endpoints = {}
        for model in MODELS.values():
            payloads = model.payloads(samples)
            knee = knee_throughput(
                served.url + model.path, payloads, float(model.route(served.manifest).max_latency_ms)
            )
            endpoints[model.path] = (served.url + model.path, payloads, knee)
        # The endpoints share the machine: together they offer `load` of it, half each.
        endpoints = {path: (u, p, args.load * knee / len(endpoints)) for path, (u, p, knee) in endpoints.items()}
        print(
            f"soaking {', '.join(f'{p} at {r:.1f}/s' for p, (_, _, r) in endpoints.items())} for {args.duration_s:g} s"
        )
        run = uvloop.run(soak(endpoints, served.pid, args))
    results = served.record | summarize(run, endpoints, args.duration_s)
    print_summary(results)
    served.finish(results, lambda path: write_plot(results, run, path))
    return 0 if results["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
