"""`make bench` / `python -m bench.serving`: the limit, optiserve and a naive server, side by side.

One run, one machine, the same model files and the same inputs (the project's sample photos
and texts), the load generator (`loadtest`) in this process:

- limit: in-process decode/tokenize + ONNX Runtime at the best batch size (bench/limit.py);
- optiserve: `bentoml serve service:Optiserve` over a model store and serving manifest, with the
  models in the front process (the default placement); `optiserve-service` is the same with
  one BentoML model service per model (`OPTISERVE_MODEL_PLACEMENT=service`), for comparison;
- naive: bench/naive_server.py, FastAPI + PyTorch eager + JSON float lists, one request per
  inference.

Each server runs alone while it is measured. Throughput is compared at each server's knee
(the highest throughput with p99 within the SLO and no errors), as the issue asks; the
figures, ratios and target verdicts are printed and written to reports/bench/. Where wrk is
installed, each sweep is checked against it (bench/wrk.py): wrk at the knee's concurrency,
same endpoint and bodies, must read the same throughput within 5 %, or the load generator
was the bottleneck.

What the server adds at concurrency 1 is judged on one input, the stall check's, against the
limit's batch-1 latency on that same input, read with wrk where it is installed, the issue's
yardstick (the load tester's own reading is recorded beside it). The sweep's c=1 p50 is of the
input mix, and so is the limit's batch 1, but the two medians of a mix are not a latency
difference: the sample photos' decode times fall in two clusters (JPEGs, about 6 ms; PNGs, 10
to 15 ms), half the requests in each, so either median lands anywhere in the gap between
them. It is recorded beside the verdict, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import cached_property
from importlib import metadata as package_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.wrk import run_wrk, wrk_installed
from loadtest.sweep import CONCURRENCY_LEVELS

if TYPE_CHECKING:
    from loadtest.inputs import Payload

REPO = Path(__file__).resolve().parent.parent
SAMPLE_TEXTS = 64


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--manifest",
        type=Path,
        help="serve the models this manifest names from the store in $BENTOML_HOME "
        "(default: build both recipes into a temporary store)",
    )
    parser.add_argument("--models", default="image,text", help="which of image,text to measure")
    parser.add_argument(
        "--placements",
        default="in-process,service",
        help="optiserve model placements to measure; the first is the one held to the targets",
    )
    parser.add_argument(
        "--concurrency",
        default=",".join(f"{level:g}" for level in CONCURRENCY_LEVELS),
        help="closed-loop levels for both servers",
    )
    parser.add_argument("--slo-ms", type=float, default=500.0, help="p99 objective that defines the knee")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--limit-seconds", type=float, default=4.0, help="measuring time per limit figure")
    parser.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also serve this commit of optiserve (a temporary git worktree) as the baseline to beat",
    )
    parser.add_argument(
        "--baseline-manifest", type=Path, help="the manifest the baseline serves (default: --manifest's)"
    )
    parser.add_argument("--wrk-seconds", type=float, default=5.0, help="wrk's run at each knee (when installed)")
    parser.add_argument(
        "--stall-seconds", type=float, default=10.0, help="one input sent at concurrency 1 for the stall check"
    )
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench")
    parser.add_argument("--quick", action="store_true", help="a smoke run: short windows, levels 1 and 4")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.warmup, args.window, args.max_windows = "1,4", 0.5, 1.0, 3
        args.limit_seconds, args.wrk_seconds, args.stall_seconds = 1.0, 2.0, 2.0
    return args


class Samples:
    """What every bench sends: the sample photos (or, `phone_photos`, the same at a phone camera's
    12 megapixels) and SAMPLE_TEXTS corpus sentences, each made when a bench first asks (the bulk
    bench sends no photo)."""

    def __init__(self, *, phone_photos: bool = False) -> None:
        self.phone_photos = phone_photos

    @cached_property
    def files(self) -> dict[str, bytes]:
        if self.phone_photos:
            from sample_inputs import phone_photos

            return {f"{name}.jpg": data for name, data in phone_photos().items()}
        from loadtest.inputs import sample_photo_files

        return sample_photo_files()

    @cached_property
    def texts(self) -> list[str]:
        from sample_inputs import sample_texts

        return sample_texts(SAMPLE_TEXTS)


@dataclass(frozen=True)
class BenchModel:
    """A served default model as the benches see it: its endpoint, its requests, its targets."""

    endpoint: str  # the manifest's route and the URL path
    limit_share: float  # the share of the in-process limit its knee must reach
    baseline_gain: float | None  # its knee against the baseline server's, where a target names one
    payloads: Callable[[Samples], list]  # one item per request
    naive_payloads: Callable[[Samples], tuple[list, str]]  # the naive server's requests and path
    limit_inputs: Callable[[Samples], Sequence]  # what bench/limit.py measures the limit on
    one_input: Callable[[list], Payload]  # of `payloads`: the one request of the stall check
    limit_input: Callable[[Payload], Sequence | dict]  # that request as bench/limit.py's inputs

    @property
    def path(self) -> str:
        return f"/{self.endpoint}"

    def route(self, manifest: Any) -> Any:
        return getattr(manifest, self.endpoint)


def first_of_type(payloads: list[Payload], content_type: str) -> Payload:
    """The stall check's photo: the first request of this content type."""
    return next(p for p in payloads if p.content_type == content_type)


def sentence_near(payloads: list[Payload], words: int) -> Payload:
    """The stall check's text: the one-sentence request nearest `words` words long (a 12-word
    sentence is about 16 tokens)."""
    return min(payloads, key=lambda p: abs(len(json.loads(p.body)["texts"][0].split()) - words))


def _image_payloads(samples: Samples) -> list:
    from loadtest.inputs import image_payloads

    return image_payloads(samples.files)


def _text_payloads(samples: Samples) -> list:
    from loadtest.inputs import text_payloads

    return text_payloads(samples.texts)


# Images are bound by the engine; a short text costs the engine about as much as its HTTP exchange.
MODELS = {
    "image": BenchModel(
        "classify",
        0.9,
        None,
        _image_payloads,
        lambda samples: (naive_pixel_payloads(samples.files, REPO / "models" / "image-classifier.yaml"), "/predict"),
        lambda samples: samples.files,
        lambda payloads: first_of_type(payloads, "image/jpeg"),
        lambda payload: {payload.name: payload.body},
    ),
    "text": BenchModel(
        "embed",
        0.6,
        2.0,
        _text_payloads,
        lambda samples: (_text_payloads(samples), "/embed"),
        lambda samples: samples.texts,
        lambda payloads: sentence_near(payloads, 12),
        lambda payload: json.loads(payload.body)["texts"],
    ),
}


def model_names(args: argparse.Namespace) -> list[str]:
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    return names


def machine() -> dict[str, Any]:
    memory_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    from serving.cpu import cpu_name, isa_flags

    packages = ("bentoml", "onnxruntime", "openvino", "torch", "numpy")
    versions = {name: package_metadata.version(name) for name in packages}
    return {
        "cpu": cpu_name(),
        "isa": list(isa_flags()),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory_kib / 2**20, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "load_average_at_start": os.getloadavg(),
    }


def run_record(args: argparse.Namespace, manifest: Path) -> dict[str, Any]:
    """What every bench's JSON starts with: the machine, the settings, the time."""
    return {
        "machine": machine(),
        "settings": vars(args) | {"manifest": str(manifest)},
        "server_settings": {name: value for name, value in os.environ.items() if name.startswith("OPTISERVE_")},
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def server_env(manifest: Path) -> dict[str, str]:
    """The environment a bench's `bentoml serve` runs with: the manifest's models, no hub."""
    return {**os.environ, "OPTISERVE_MANIFEST": str(manifest), "HF_HUB_OFFLINE": "1"}


def write_record(results: dict[str, Any], path: Path) -> None:
    """The JSON of a run, with the load average at its end (the machine is shared)."""
    results["machine"]["load_average_at_end"] = os.getloadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def prepare_store(args: argparse.Namespace) -> Path:
    """The manifest to serve; builds both recipes into a fresh BENTOML_HOME when none is given."""
    if args.manifest is not None:
        return args.manifest.resolve()
    home = Path(tempfile.mkdtemp(prefix="optiserve-bench-bentoml-"))
    os.environ["BENTOML_HOME"] = str(home)  # before anything imports bentoml
    from pipeline.build import build
    from pipeline.recipe import load_recipe
    from serving.manifest import ServingManifest, write_manifest

    routes = {}
    for name in ("image-classifier", "text-embedder"):
        loaded = load_recipe(REPO / "models" / f"{name}.yaml")
        print(f"building {name} into {home} …", file=sys.stderr)
        routes[loaded.recipe.serving.endpoint] = build(loaded).route(loaded)
    manifest = home / "serving-manifest.json"
    write_manifest(ServingManifest(**routes), manifest)
    return manifest


@dataclass(frozen=True)
class ServedRun:
    """One bench's optiserve server with what its record needs."""

    url: str
    pid: int
    manifest: Any  # serving.manifest.ServingManifest
    record: dict[str, Any]  # run_record, taken before the run: the machine's load at its start
    out: Path  # the run's JSON; its plot goes beside it
    log: Path  # the server's

    def finish(self, results: dict[str, Any], plot: Callable[[Path], None]) -> None:
        write_record(results, self.out)
        plot(self.out.with_suffix(".png"))
        print(f"wrote {self.out} and {self.out.with_suffix('.png')}", file=sys.stderr)


@contextmanager
def served_run(args: argparse.Namespace, name: str) -> Iterator[ServedRun]:
    """`bentoml serve` of the manifest's models (built first when no --manifest is given), its log
    and its JSON named after the bench and the time."""
    manifest_path = prepare_store(args)
    from bench.processes import OPTISERVE, on_free_port
    from serving.manifest import load_manifest

    manifest = load_manifest(manifest_path)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    record = run_record(args, manifest_path)
    log = args.out / f"logs-{stamp}" / f"optiserve-{name}.log"
    with on_free_port(OPTISERVE, env=server_env(manifest_path), cwd=REPO, log=log) as server:
        yield ServedRun(server.url, server.pid, manifest, record, args.out / f"{name}-{stamp}.json", log)


def naive_pixel_payloads(files: dict[str, bytes], recipe_path: Path) -> list:
    """Client-side decode, resize, normalize and JSON-encode, done once per photo before any load."""
    import numpy as np

    from loadtest.inputs import Payload
    from pipeline.recipe import load_recipe
    from serving.classify import ImageUpload, prepare_image

    image = load_recipe(recipe_path).recipe.image
    spec = image.input_spec()
    mean, std = np.asarray(image.mean, dtype=np.float32), np.asarray(image.std, dtype=np.float32)
    payloads = []
    for name, data in sorted(files.items()):
        pixels = (prepare_image(ImageUpload(data, None, name), spec).astype(np.float32) - mean) / std
        body = json.dumps({"data": pixels.transpose(2, 0, 1).ravel().tolist()}).encode()
        payloads.append(Payload(name, body, "application/json"))
    return payloads


def sweep(url: str, payloads: list, args: argparse.Namespace, *, input_kind: str) -> dict[str, Any]:
    """The loadtest sweep's JSON document, with the check against wrk under `wrk_check`."""
    from rich.console import Console

    from loadtest.report import print_report, to_json
    from loadtest.sweep import SweepSettings, run_sweep

    settings = SweepSettings(
        url=url,
        levels=tuple(float(c) for c in args.concurrency.split(",")),
        slo_ms=args.slo_ms,
        warmup_s=args.warmup,
        window_s=args.window,
        max_windows=args.max_windows,
        max_duration_s=300,
    )
    print(f"sweeping {url} …", file=sys.stderr)
    result = run_sweep(settings, payloads, {"kind": input_kind, "items": len(payloads)})
    print_report(result, Console(stderr=True, width=160))
    document = to_json(result)
    if not wrk_installed():
        document["wrk_check"] = {"skipped": "wrk not installed"}
    elif result.knee is None:
        document["wrk_check"] = {"skipped": "no knee"}
    else:
        document["wrk_check"] = wrk_check(url, payloads, result.knee.level, result.knee.throughput, args.wrk_seconds)
    return document


WRK_ROUNDS = 3  # each generator's runs, alternated: a shared host's minute of noise moves a whole run


def wrk_check(url: str, payloads: list, concurrency: float, throughput: float, seconds: float) -> dict[str, Any]:
    """The load tester and wrk, alternately, at the knee's concurrency: the median of each round's
    ratio must be within 5 % of 1. One wrk run after the sweep, against the sweep's own figure, read
    0.8 to 1.3 × on this machine: runs a minute apart differ by more than the generators do, runs
    side by side do not, so the check compares generators and not moments."""
    import statistics

    print(f"wrk and the load tester alternately at concurrency {concurrency:g} on {url} …", file=sys.stderr)
    connections = int(concurrency)
    # A warm-up, not counted: the sweep's last level (past the knee) may still be draining.
    run_wrk(url, payloads, connections=connections, seconds=1)
    ours, theirs = [], []
    for _ in range(WRK_ROUNDS):
        ours.append(loadtest_throughput(url, payloads, connections, seconds))
        theirs.append(run_wrk(url, payloads, connections=connections, seconds=seconds))
    loadtest, wrk = statistics.median(ours), statistics.median(r.throughput for r in theirs)
    rounds = zip(ours, theirs, strict=True)
    ratio = statistics.median(a / b.throughput if b.throughput else float("inf") for a, b in rounds)
    return {
        "concurrency": concurrency,
        "loadtest_throughput": loadtest,
        "wrk_throughput": wrk,
        "ratio": ratio,
        "target": "within 5 %",
        "met": abs(ratio - 1) <= 0.05,
        "sweep_knee_throughput": throughput,
        "loadtest_runs": ours,
        "wrk_runs": [asdict(r) for r in theirs],
    }


def closed_loop_outcomes(url: str, payloads: list, concurrency: int, seconds: float) -> tuple[list, float]:
    """The load tester's closed loop at `concurrency` for `seconds`: the outcomes that finished in
    that time, and the time."""
    import asyncio

    import uvloop

    from loadtest.client import Pool
    from loadtest.generator import closed_loop, post_requests
    from loadtest.stats import Recorder

    async def run() -> tuple[list, float]:
        recorder, stop, pool = Recorder(), asyncio.Event(), Pool(url, timeout=30)
        loop = asyncio.create_task(
            closed_loop(pool, post_requests(url, payloads), concurrency=concurrency, stop=stop, recorder=recorder)
        )
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        stop.set()
        ended = time.perf_counter()
        await loop
        pool.close()
        return recorder.between(started, ended), ended - started

    return uvloop.run(run())


def loadtest_throughput(url: str, payloads: list, concurrency: int, seconds: float) -> float:
    """Successful answers per second of the load tester's closed loop."""
    outcomes, elapsed = closed_loop_outcomes(url, payloads, concurrency, seconds)
    return sum(o.ok for o in outcomes) / elapsed


def stall_check(url: str, payload: Payload, seconds: float) -> dict[str, Any]:
    """One request, always the same, at concurrency 1: every input costs the same, so a p99 far
    above the p50 is the server stalling (the collector, a timer, a hand-off), not a longer
    input. The sweep's c=1 figures are of the input mix, whose spread the engine has too."""
    from loadtest.stats import summarize

    print(f"one input ({payload.name}) at concurrency 1 on {url} …", file=sys.stderr)
    closed_loop_outcomes(url, [payload], 1, 1.0)  # warm-up: the sweep's last level may still drain
    outcomes, elapsed = closed_loop_outcomes(url, [payload], 1, seconds)
    latency = summarize(outcomes, elapsed).latency_ms
    return {
        "input": payload.name,
        "requests": len(outcomes),
        "p50_ms": latency.p50 if latency else None,
        "p99_ms": latency.p99 if latency else None,
        "max_ms": latency.max if latency else None,
    }


def served(sweep_json: dict[str, Any]) -> dict[str, Any]:
    """The figures the comparison needs from one sweep."""
    knee = sweep_json["knee"]
    levels = sweep_json["levels"]
    first = levels[0] if levels else None
    c1 = first["result"]["latency_ms"] if first and first["level"] == 1 else None
    at_knee = next((lv for lv in levels if knee and lv["level"] == knee["level"]), None)
    below_knee = [lv for lv in levels if knee and lv["level"] < knee["level"]]
    return {
        "knee_throughput": knee["throughput"] if knee else None,
        "knee_p99_ms": knee["p99_ms"] if knee else None,
        "knee_p50_ms": at_knee["result"]["latency_ms"]["p50"] if at_knee else None,
        "knee_concurrency": knee["level"] if knee else None,
        "c1_p50_ms": c1["p50"] if c1 else None,
        "c1_p99_ms": c1["p99"] if c1 else None,
        "c1_throughput": first["result"]["throughput"] if first else None,
        "errors_below_knee": sum(sum(lv["result"]["errors"].values()) for lv in below_knee),
        "p99_by_concurrency": {
            lv["level"]: lv["result"]["latency_ms"]["p99"] if lv["result"]["latency_ms"] else None for lv in levels
        },
        "c1_server": first["server"] if first else None,
        "knee_server": at_knee["server"] if at_knee else None,
        "loadtest_vs_wrk": sweep_json["wrk_check"],
        "one_input_c1": sweep_json.get("stall_check"),
    }


def verdicts(model: str, figures: dict[str, Any], baseline: str | None) -> dict[str, Any]:
    """Each target with its measured ratio or margin and a pass flag."""
    limit, optiserve, naive = figures["limit"], figures["optiserve"], figures["naive"]
    out: dict[str, Any] = {}
    opt_qps = optiserve["knee_throughput"]
    targets = MODELS[model]
    out["optiserve_vs_limit_throughput"] = _ratio(opt_qps, limit["throughput"], targets.limit_share)
    out["optiserve_vs_naive_throughput"] = _ratio(opt_qps, naive["knee_throughput"], 5.0)
    if baseline is not None and targets.baseline_gain is not None:
        out[f"optiserve_vs_{baseline}_throughput"] = _ratio(
            opt_qps, figures[baseline]["knee_throughput"], targets.baseline_gain
        )
    c1_p50, c1_p99 = optiserve["c1_p50_ms"], optiserve["c1_p99_ms"]
    one = optiserve["one_input_c1"] or {}
    out["c1_p99_vs_p50"] = _ratio(one.get("p99_ms"), one.get("p50_ms"), 2.0, at_most=True) | {"input": one.get("input")}
    # On the mix, no more spread than the engine's own at batch 1 on the same inputs, or 2 ×.
    engine_spread = limit["batch1_p99_ms"] / limit["batch1_p50_ms"]
    mix = _ratio(c1_p99, c1_p50, max(2.0, engine_spread), at_most=True)
    out["c1_p99_vs_p50_mix"] = mix | {"engine_batch1_p99_vs_p50": engine_spread}
    out["knee_p99_vs_p50"] = _ratio(optiserve["knee_p99_ms"], optiserve["knee_p50_ms"], 3.0, at_most=True)
    alone = limit.get("one_input") or {}
    if one.get("p50_ms") is not None and alone.get("input") == one.get("input"):
        read_with = "wrk" if one.get("wrk_p50_ms") is not None else "loadtest"
        margin = one["wrk_p50_ms" if read_with == "wrk" else "p50_ms"] - alone["batch1_p50_ms"]
        mix_margin = None if c1_p50 is None else c1_p50 - limit["batch1_p50_ms"]
        out["c1_p50_vs_limit_batch1"] = {
            "input": one["input"],
            "excess_ms": margin,
            "target": "<= 1.5 ms",
            "met": margin <= 1.5,
            "read_with": read_with,
            "loadtest_excess_ms": one["p50_ms"] - alone["batch1_p50_ms"],  # not judged: see above
            "mix_excess_ms": mix_margin,  # not judged: see the module's docstring
        }
    errors = optiserve["errors_below_knee"]
    out["no_errors_below_the_knee"] = {"errors": errors, "met": errors == 0 and opt_qps is not None}
    return out


def _ratio(value: float | None, reference: float | None, target: float, *, at_most: bool = False) -> dict[str, Any]:
    if value is None or not reference:
        return {"ratio": None, "target": f"{'<=' if at_most else '>='} {target:g}", "met": False}
    ratio = value / reference
    return {
        "ratio": ratio,
        "target": f"{'<=' if at_most else '>='} {target:g}",
        "met": ratio <= target if at_most else ratio >= target,
    }


def print_summary(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="serving benchmark (throughput at each server's knee)")
    for column in ("model", "server", "items/s", "p50 / p99 ms at knee", "knee conc.", "p50 / p99 ms at c=1"):
        table.add_column(column, justify="right")
    for model, figures in results["models"].items():
        limit = figures["limit"]
        table.add_row(
            model,
            f"limit (batch {limit['best_batch']}; served ≤ {limit['served_max_batch_size']})",
            f"{limit['throughput']:.1f}",
            f"- / {limit['batch_p99_ms']:.1f} (batch)",
            "-",
            f"{limit['batch1_p50_ms']:.1f} / {limit['batch1_p99_ms']:.1f} (batch 1)",
        )
        for name in results["servers"]:
            row = figures[name]
            table.add_row(
                model,
                name,
                number_text(row["knee_throughput"]),
                f"{number_text(row['knee_p50_ms'])} / {number_text(row['knee_p99_ms'])}",
                number_text(row["knee_concurrency"], "g"),
                f"{number_text(row['c1_p50_ms'])} / {number_text(row['c1_p99_ms'])}",
            )
    console = Console(width=160)
    console.print(table)
    for model, figures in results["models"].items():
        for name, verdict in figures["targets"].items():
            console.print(f"{model}: {name}: {verdict_text(verdict)}")
        for name in results["servers"]:
            check = figures[name]["loadtest_vs_wrk"]
            runs = ("loadtest_runs", "wrk_runs")
            shown = f"skipped ({check['skipped']})" if "skipped" in check else verdict_text(check, leave_out=runs)
            console.print(f"{model}: {name}: loadtest throughput within 5 % of wrk: {shown}")


def verdict_text(verdict: dict[str, Any], leave_out: tuple[str, ...] = ()) -> str:
    """A target's figures and its met/missed mark, for the printed summaries of every bench."""
    shown = {
        k: (round(v, 2) if isinstance(v, float) else v) for k, v in verdict.items() if k not in ("met", *leave_out)
    }
    return f"{shown} → {'[green]met[/green]' if verdict['met'] else '[red]missed[/red]'}"


def phased_parser(prog: str, doc: str, clients: str) -> argparse.ArgumentParser:
    """The options of a bench in phases (unloaded, beside something, unloaded again) over one
    served manifest: bench/bulk.py and bench/priorities.py."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, help="serve this manifest's models (default: build both recipes)")
    parser.add_argument("--concurrency", type=int, default=1, help=clients)
    parser.add_argument("--unloaded-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench")
    return parser


def phase_figures(recorder: Any, start: float, end: float) -> dict[str, Any]:
    """Requests that finished in [start, end) of a `loadtest.stats.Recorder`: how many, the failed
    by status, the latency of the others (the benches that run phases under one load share it)."""
    from collections import Counter

    from loadtest.stats import latency_ms

    outcomes = recorder.between(start, end)
    latency = latency_ms([o.latency for o in outcomes if o.ok])
    errors = Counter(o.status for o in outcomes if not o.ok)
    return {
        "requests": len(outcomes),
        "failed": errors.total(),
        "errors": dict(errors),
        "latency_ms": asdict(latency) if latency else None,
    }


def phases_around(
    recorder: Any, marks: dict[str, float], during: str, span: tuple[str, str], within: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`phase_figures` before, during and after a span of a run under one load (`marks` from its
    "start" to its "end"), and the target on them: p99 during the span within `within` × before."""
    begin, end = (marks[key] for key in span)
    phases = {
        "unloaded_before": phase_figures(recorder, marks["start"], begin),
        f"during_{during}": phase_figures(recorder, begin, end),
        "unloaded_after": phase_figures(recorder, end, marks["end"]),
    }
    reference, loaded = phases["unloaded_before"]["latency_ms"], phases[f"during_{during}"]["latency_ms"]
    ratio = loaded["p99"] / reference["p99"] if loaded and reference else None
    target = {"p99_during_vs_unloaded": ratio, "target": f"<= {within}", "met": ratio is not None and ratio <= within}
    return phases, target


def phase_table(title: str, phases: dict[str, dict], extra: dict[str, Callable[[dict], str]] | None = None) -> Any:
    """A table of `phase_figures` phases; `extra` adds columns (header → a phase's cell)."""
    from rich.table import Table

    extra = extra or {}
    table = Table(title=title)
    for column in ("phase", "requests", "failed", "p50 ms", "p99 ms", "max ms", *extra):
        table.add_column(column, justify="right")
    for name, phase in phases.items():
        latency = phase["latency_ms"] or {}
        figures = (number_text(latency.get(key), ".2f") for key in ("p50", "p99", "max"))
        table.add_row(name, str(phase["requests"]), str(phase["failed"]), *figures, *(c(phase) for c in extra.values()))
    return table


def latency_timeline(
    run: dict, spans: list[tuple[float, float]], span_label: str, reference: tuple[float, str], text: tuple[str, str]
) -> Any:
    """Each request's latency (`run["outcomes"]`) against time from `run["marks"]["start"]`, the
    `spans` shaded, a dashed line at `reference` (ms, label); `text` is (y label, title)."""
    from loadtest.report import pyplot

    plt = pyplot()
    start, outcomes = run["marks"]["start"], run["outcomes"].outcomes
    figure, axes = plt.subplots(figsize=(8, 4))
    axes.scatter([o.finished - start for o in outcomes], [1000 * o.latency for o in outcomes], s=2, alpha=0.4)
    for index, (begin, end) in enumerate(spans):
        axes.axvspan(begin - start, end - start, color="orange", alpha=0.2, label=span_label if index == 0 else None)
    axes.axhline(reference[0], color="red", linestyle="--", label=reference[1])
    axes.set_yscale("log")
    axes.set_xlabel("seconds")
    axes.set_ylabel(text[0])
    axes.set_title(text[1])
    axes.legend()
    return figure


def number_text(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


@contextmanager
def git_checkout(ref: str) -> Iterator[Path]:
    """A detached worktree of `ref`, removed afterwards: the baseline runs its own code."""
    folder = Path(tempfile.mkdtemp(prefix="optiserve-baseline-")) / "checkout"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), ref], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], check=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    models = model_names(args)
    started = time.monotonic()
    manifest_path = prepare_store(args)

    import bentoml

    from bench.limit import measure_limit
    from bench.processes import OPTISERVE, on_free_port
    from serving.manifest import load_manifest
    from serving.settings import PLACEMENT_ENV

    manifest = load_manifest(manifest_path)
    samples = Samples()
    results: dict[str, Any] = run_record(args, manifest_path)
    results["models"] = {m: {} for m in models}
    results["servers"] = []
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    logs = args.out / f"logs-{stamp}"
    if not wrk_installed():
        print("wrk is not installed: the sweeps are not checked against it (apt-get install wrk)", file=sys.stderr)

    for model in models:
        route = MODELS[model].route(manifest)
        print(f"measuring the {model} limit …", file=sys.stderr)
        inputs = MODELS[model].limit_inputs(samples)
        stored = bentoml.models.get(route.tag)
        limit = measure_limit(stored, inputs, seconds=args.limit_seconds, slo_ms=args.slo_ms)
        one = MODELS[model].one_input(MODELS[model].payloads(samples))
        alone = measure_limit(
            stored, MODELS[model].limit_input(one), seconds=args.limit_seconds, slo_ms=args.slo_ms, batch_sizes=(1,)
        )
        results["models"][model]["limit"] = asdict(limit) | {
            "served_max_batch_size": route.max_batch_size,
            "one_input": {
                "input": one.name,
                "batch1_p50_ms": alone.batch1_p50_ms,
                "batch1_p99_ms": alone.batch1_p99_ms,
            },
        }

    env = server_env(manifest_path)

    def payloads_for(model: str) -> tuple[list, str]:
        return MODELS[model].payloads(samples), MODELS[model].path

    def naive_payloads_for(model: str) -> tuple[list, str]:
        return MODELS[model].naive_payloads(samples)

    def measure_server(
        name: str, command: list[str], env: dict[str, str], cwd: Path, payloads_for, *, stall: bool = True
    ) -> None:
        """`stall`: also the stall check (optiserve's requests only: the naive server takes pixels)."""
        with on_free_port(command, env=env, cwd=cwd, log=logs / f"{name}.log") as server:
            url = server.url
            for model in models:
                payloads, path = payloads_for(model)
                document = sweep(url + path, payloads, args, input_kind=model)
                if stall:
                    one = MODELS[model].one_input(payloads)
                    document["stall_check"] = stall_check(url + path, one, args.stall_seconds)
                    if wrk_installed():
                        by_wrk = run_wrk(url + path, [one], connections=1, seconds=args.stall_seconds)
                        document["stall_check"]["wrk_p50_ms"] = by_wrk.p50_ms
                results["models"][model][f"{name}_sweep"] = document
        results["servers"].append(name)

    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    for index, placement in enumerate(placements):
        name = "optiserve" if index == 0 else f"optiserve-{placement}"
        measure_server(name, OPTISERVE, {**env, PLACEMENT_ENV: placement}, REPO, payloads_for)
    baseline = None
    if args.baseline:
        baseline = f"baseline-{args.baseline}"
        baseline_manifest = (args.baseline_manifest or manifest_path).resolve()
        with git_checkout(args.baseline) as checkout:
            measure_server(
                baseline, OPTISERVE, {**env, "OPTISERVE_MANIFEST": str(baseline_manifest)}, checkout, payloads_for
            )
    measure_server("naive", [sys.executable, "-m", "bench.naive_server"], env, REPO, naive_payloads_for, stall=False)

    for model, figures in results["models"].items():
        for name in results["servers"]:
            figures[name] = served(figures[f"{name}_sweep"])
        figures["targets"] = verdicts(model, figures, baseline)
    results["seconds"] = round(time.monotonic() - started, 1)
    print_summary(results)
    path = args.out / f"serving-{stamp}.json"
    write_record(results, path)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
