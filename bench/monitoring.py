"""`python -m bench.monitoring`: what prediction and input monitoring costs in throughput at the knee.

One `bentoml serve` of the manifest's models at a time, restarted between measurements with
monitoring on (the default) and off (`OPTISERVE_MONITORING=0`), alternating, the order flipped
every round. Per server: wrk at each endpoint's knee concurrency (`--concurrency`, from a
`python -m loadtest` sweep) for `--seconds` after `--warmup` seconds of the same load, one photo
per /classify request and one corpus sentence per /embed request. The figure per endpoint is the
median over rounds of the on ÷ off ratio of requests per second; on a shared machine only the
ratios of one round, measured minutes apart at most, compare like with like.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def measure(
    setting: str, args: argparse.Namespace, bodies: dict[str, list[Payload]], log: Path
) -> dict[str, WrkResult]:
    """One server with monitoring `setting`: wrk per endpoint at its knee, after a warm-up."""
    env = {**os.environ, "OPTISERVE_MANIFEST": str(args.manifest), **SETTINGS[setting]}
    results = {}
    with on_free_port(OPTISERVE, env=env, cwd=REPO, log=log) as server:
        for endpoint, connections in args.concurrency.items():
            url = f"{server.url}/{endpoint}"
            run_wrk(url, bodies[endpoint], connections=connections, seconds=args.warmup)
            results[endpoint] = run_wrk(url, bodies[endpoint], connections=connections, seconds=args.seconds)
    return results


def concurrency(text: str) -> dict[str, int]:
    """`classify=8,embed=4`"""
    return {name: int(value) for name, value in (part.split("=") for part in text.split(","))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "serving-manifest.json")
    parser.add_argument("--concurrency", type=concurrency, default=concurrency("classify=8,embed=8"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench" / "monitoring.json")
    args = parser.parse_args(argv)
    bodies = payloads()
    rounds = []
    for index in range(args.rounds):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        measured = {s: measure(s, args, bodies, args.out.with_name(f"monitoring-{index}-{s}.log")) for s in order}
        rounds.append({s: {e: asdict(r) for e, r in measured[s].items()} for s in order})
        print(
            f"round {index + 1}: "
            + ", ".join(
                f"/{e} on {measured['on'][e].throughput:.1f} off {measured['off'][e].throughput:.1f} req/s"
                for e in args.concurrency
            ),
            flush=True,
        )
    ratios = {e: [r["on"][e]["throughput"] / r["off"][e]["throughput"] for r in rounds] for e in args.concurrency}
    summary = {e: {"ratios": values, "median": statistics.median(values)} for e, values in ratios.items()}
    for endpoint, figures in summary.items():
        rounded = ", ".join(f"{v:.3f}" for v in figures["ratios"])
        print(f"/{endpoint} at c={args.concurrency[endpoint]}: on/off {rounded}, median {figures['median']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": describe_cpu(), "concurrency": args.concurrency, "rounds": rounds, "summary": summary}
    args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
