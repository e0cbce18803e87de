"""`python -m bench.monitoring`: what prediction and input monitoring costs in throughput at the knee.

One `bentoml serve` of the manifest's models at a time, restarted between measurements with
monitoring on (the default) and off (`OPTISERVE_MONITORING=0`), alternating, the order flipped
every round. Per server: wrk at each endpoint's knee concurrency (`--concurrency`, from a
`python -m loadtest` sweep) for `--seconds` after `--warmup` seconds of the same load, one photo
per /classify request and one corpus sentence per /embed request. The figures per endpoint are
the medians over rounds of the on ÷ off ratios of requests per second and of the server's CPU
time per request (all its processes, user and system): on a shared machine the neighbours move
throughput by tens of percent from one minute to the next, the CPU a request costs much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from bench.processes import OPTISERVE, on_free_port
from bench.wrk import WrkResult, run_wrk
from loadtest.inputs import Payload, default_texts, image_payloads, sample_photo_files, text_payloads
from serving.cpu import describe_cpu

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"on": {}, "off": {"OPTISERVE_MONITORING": "0"}}


def payloads() -> dict[str, list[Payload]]:
    return {"classify": image_payloads(sample_photo_files()), "embed": text_payloads(default_texts())}


def wrk(url: str, bodies: list[Payload], *, connections: int, seconds: float) -> WrkResult:
    """`run_wrk`, once more if wrk itself failed, saying why."""
    try:
        return run_wrk(url, bodies, connections=connections, seconds=seconds)
    except subprocess.CalledProcessError as exc:
        print(f"wrk failed: {(exc.stderr or exc.stdout or '').strip()[-500:]}; once more", flush=True)
        return run_wrk(url, bodies, connections=connections, seconds=seconds)


def measure(setting: str, args: argparse.Namespace, bodies: dict[str, list[Payload]], log: Path) -> dict[str, dict]:
    """One server with monitoring `setting`: wrk per endpoint at its knee after a warm-up (its
    figures, and the server's CPU time per request meanwhile)."""
    env = {**os.environ, "OPTISERVE_MANIFEST": str(args.manifest), **SETTINGS[setting]}
    results = {}
    with on_free_port(OPTISERVE, env=env, cwd=REPO, log=log) as server:
        for endpoint, connections in args.concurrency.items():
            url = f"{server.url}/{endpoint}"
            wrk(url, bodies[endpoint], connections=connections, seconds=args.warmup)
            cpu_before = cpu_seconds(server.process.pid)
            measured = wrk(url, bodies[endpoint], connections=connections, seconds=args.seconds)
            cpu_ms = 1000 * (cpu_seconds(server.process.pid) - cpu_before) / max(1, measured.requests)
            results[endpoint] = {**asdict(measured), "cpu_ms_per_request": cpu_ms}
    return results


def cpu_seconds(supervisor: int) -> float:
    """User and system CPU time of the server's processes so far."""
    import psutil

    total = 0.0
    for process in [psutil.Process(supervisor), *psutil.Process(supervisor).children(recursive=True)]:
        times = process.cpu_times()
        total += times.user + times.system
    return total


FIGURES = ("throughput", "cpu_ms_per_request")


def figure(measured: dict, endpoint: str, name: str) -> str:
    return f"{measured['on'][endpoint][name]:.1f} / {measured['off'][endpoint][name]:.1f}"


def ratios(rounds: list[dict], endpoint: str, name: str) -> dict:
    values = [r["on"][endpoint][name] / r["off"][endpoint][name] for r in rounds]
    return {"ratios": values, "median": statistics.median(values)}


def concurrency(text: str) -> dict[str, int]:
    """`classify=8,embed=4`"""
    return {name: int(value) for name, value in (part.split("=") for part in text.split(","))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "serving-manifest.json")
    parser.add_argument("--concurrency", type=concurrency, default=concurrency("classify=8,embed=8"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench" / "monitoring.json")
    args = parser.parse_args(argv)
    bodies = payloads()
    rounds = []
    for index in range(args.rounds):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        rounds.append({s: measure(s, args, bodies, args.out.with_name(f"monitoring-{index}-{s}.log")) for s in order})
        figures = (f"/{e} {figure(rounds[-1], e, FIGURES[0])} req/s" for e in args.concurrency)
        print(f"round {index + 1} on/off: " + ", ".join(figures), flush=True)
    summary = {e: {f: ratios(rounds, e, f) for f in FIGURES} for e in args.concurrency}
    for endpoint, found in summary.items():
        for name, values in found.items():
            rounded = ", ".join(f"{v:.3f}" for v in values["ratios"])
            print(f"/{endpoint} c={args.concurrency[endpoint]} {name} on/off: {rounded}; median {values['median']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": describe_cpu(), "concurrency": args.concurrency, "rounds": rounds, "summary": summary}
    args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
