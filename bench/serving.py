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
figures, ratios and target verdicts are printed and written to reports/bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

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
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="closed-loop levels for both servers")
    parser.add_argument("--slo-ms", type=float, default=500.0, help="p99 objective that defines the knee")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--limit-seconds", type=float, default=4.0, help="measuring time per limit figure")
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench")
    parser.add_argument("--quick", action="store_true", help="a smoke run: short windows, levels 1 and 4")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.warmup, args.window, args.max_windows, args.limit_seconds = "1,4", 0.5, 1.0, 3, 1.0
    return args


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.processor())
    memory_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    versions = {name: package_metadata.version(name) for name in ("bentoml", "onnxruntime", "torch", "numpy")}
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory_kib / 2**20, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "load_average_at_start": os.getloadavg(),
    }


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


def naive_pixel_payloads(files: dict[str, bytes], recipe_path: Path) -> list:
    """Client-side decode, resize, normalize and JSON-encode, done once per photo before any load."""
    import numpy as np

    from loadtest.inputs import Payload
    from pipeline.recipe import load_recipe
    from serving.classify import ImageUpload, prepare_image
    from serving.model_spec import ImageInput

    image = load_recipe(recipe_path).recipe.image
    spec = ImageInput(size=image.size, resize=image.resize)
    mean, std = np.asarray(image.mean, dtype=np.float32), np.asarray(image.std, dtype=np.float32)
    payloads = []
    for name, data in sorted(files.items()):
        pixels = (prepare_image(ImageUpload(data, None, name), spec).astype(np.float32) - mean) / std
        body = json.dumps({"data": pixels.transpose(2, 0, 1).ravel().tolist()}).encode()
        payloads.append(Payload(name, body, "application/json"))
    return payloads


def sweep(url: str, payloads: list, args: argparse.Namespace, *, input_kind: str) -> dict[str, Any]:
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
    return to_json(result)


def served(sweep_json: dict[str, Any]) -> dict[str, Any]:
    """The figures the comparison needs from one sweep."""
    knee = sweep_json["knee"]
    first = sweep_json["levels"][0] if sweep_json["levels"] else None
    c1 = first["result"]["latency_ms"] if first and first["level"] == 1 else None
    at_knee = next((lv for lv in sweep_json["levels"] if knee and lv["level"] == knee["level"]), None)
    return {
        "knee_throughput": knee["throughput"] if knee else None,
        "knee_p99_ms": knee["p99_ms"] if knee else None,
        "knee_concurrency": knee["level"] if knee else None,
        "c1_p50_ms": c1["p50"] if c1 else None,
        "c1_throughput": first["result"]["throughput"] if first else None,
        "p99_by_concurrency": {
            lv["level"]: lv["result"]["latency_ms"]["p99"] if lv["result"]["latency_ms"] else None
            for lv in sweep_json["levels"]
        },
        "c1_server": first["server"] if first else None,
        "knee_server": at_knee["server"] if at_knee else None,
    }


def verdicts(limit: dict[str, Any], optiserve: dict[str, Any], naive: dict[str, Any]) -> dict[str, Any]:
    """The issue's three targets, each with its measured ratio or margin and a pass flag."""
    out: dict[str, Any] = {}
    opt_qps, naive_qps = optiserve["knee_throughput"], naive["knee_throughput"]
    if opt_qps is not None:
        ratio = opt_qps / limit["throughput"]
        out["optiserve_vs_limit_throughput"] = {"ratio": ratio, "target": ">= 0.75", "met": ratio >= 0.75}
    if opt_qps is not None and naive_qps is not None:
        ratio = opt_qps / naive_qps
        out["optiserve_vs_naive_throughput"] = {"ratio": ratio, "target": ">= 5", "met": ratio >= 5}
        out["optiserve_p99_below_naive_at_knees"] = {
            "optiserve_ms": optiserve["knee_p99_ms"],
            "naive_ms": naive["knee_p99_ms"],
            "met": optiserve["knee_p99_ms"] < naive["knee_p99_ms"],
        }
    common = sorted(set(optiserve["p99_by_concurrency"]) & set(naive["p99_by_concurrency"]))
    if common:
        pairs = {c: (optiserve["p99_by_concurrency"][c], naive["p99_by_concurrency"][c]) for c in common}
        out["optiserve_p99_below_naive_at_equal_concurrency"] = {
            "p99_ms_optiserve_naive": pairs,
            "met": all(o is not None and n is not None and o < n for o, n in pairs.values()),
        }
    if optiserve["c1_p50_ms"] is not None:
        margin = optiserve["c1_p50_ms"] - limit["batch1_p50_ms"]
        out["c1_p50_vs_limit_batch1"] = {"excess_ms": margin, "target": "<= 5 ms", "met": margin <= 5}
    return out


def print_summary(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="serving benchmark (throughput at each server's knee)")
    for column in ("model", "server", "items/s", "p99 ms at knee", "knee conc.", "p50 ms at c=1 / batch 1"):
        table.add_column(column, justify="right")
    for model, figures in results["models"].items():
        limit = figures["limit"]
        table.add_row(
            model,
            f"limit (batch {limit['best_batch']})",
            f"{limit['throughput']:.1f}",
            f"{limit['batch_p99_ms']:.1f} (batch)",
            "-",
            f"{limit['batch1_p50_ms']:.1f}",
        )
        for name in results["servers"]:
            row = figures[name]
            table.add_row(
                model,
                name,
                _num(row["knee_throughput"]),
                _num(row["knee_p99_ms"]),
                _num(row["knee_concurrency"], "g"),
                _num(row["c1_p50_ms"]),
            )
    console = Console(width=160)
    console.print(table)
    for model, figures in results["models"].items():
        for name, verdict in figures["targets"].items():
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in verdict.items() if k != "met"}
            mark = "[green]met[/green]" if verdict["met"] else "[red]missed[/red]"
            console.print(f"{model}: {name}: {shown} → {mark}")


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    started = time.monotonic()
    manifest_path = prepare_store(args)

    import bentoml

    from bench.limit import image_limit, text_limit
    from bench.processes import free_port, running
    from loadtest.inputs import image_payloads, sample_photo_files, text_payloads
    from pipeline.samples import sample_texts
    from serving.manifest import load_manifest
    from serving.settings import PLACEMENT_ENV

    manifest = load_manifest(manifest_path)
    files, texts = sample_photo_files(), sample_texts(SAMPLE_TEXTS)
    results: dict[str, Any] = {"machine": machine(), "settings": vars(args) | {"manifest": str(manifest_path)}}
    results["started_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    results["models"] = {m: {} for m in models}
    results["servers"] = []
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    logs = args.out / f"logs-{stamp}"

    for model in models:
        route = manifest.classify if model == "image" else manifest.embed
        stored = bentoml.models.get(route.tag)
        measure = image_limit if model == "image" else text_limit
        inputs = files if model == "image" else texts
        print(f"measuring the {model} limit …", file=sys.stderr)
        limit = measure(
            Path(stored.path),
            stored.info.metadata,
            inputs,
            max_batch=route.max_batch_size,
            seconds=args.limit_seconds,
            slo_ms=args.slo_ms,
        )
        results["models"][model]["limit"] = asdict(limit)

    env = {**os.environ, "OPTISERVE_MANIFEST": str(manifest_path), "HF_HUB_OFFLINE": "1"}
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    for index, placement in enumerate(placements):
        name = "optiserve" if index == 0 else f"optiserve-{placement}"
        results["servers"].append(name)
        port = free_port()
        command = [sys.executable, "-m", "bentoml", "serve", "service:Optiserve", "--host", "127.0.0.1"]
        command += ["--port", str(port)]
        placed = {**env, PLACEMENT_ENV: placement}
        with running(command, url=f"http://127.0.0.1:{port}", env=placed, cwd=REPO, log=logs / f"{name}.log") as url:
            for model in models:
                if model == "image":
                    payloads, path = image_payloads(files), "/classify"
                else:
                    payloads, path = text_payloads(texts), "/embed"
                results["models"][model][f"{name}_sweep"] = sweep(url + path, payloads, args, input_kind=model)
    results["servers"].append("naive")

    port = free_port()
    command = [sys.executable, "-m", "bench.naive_server", "--port", str(port)]
    with running(command, url=f"http://127.0.0.1:{port}", env=env, cwd=REPO, log=logs / "naive.log") as url:
        for model in models:
            if model == "image":
                payloads, path = naive_pixel_payloads(files, REPO / "models" / "image-classifier.yaml"), "/predict"
            else:
                payloads, path = text_payloads(texts), "/embed"
            results["models"][model]["naive_sweep"] = sweep(url + path, payloads, args, input_kind=model)

    for figures in results["models"].values():
        for name in results["servers"]:
            figures[name] = served(figures[f"{name}_sweep"])
        figures["targets"] = verdicts(figures["limit"], figures["optiserve"], figures["naive"])
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["seconds"] = round(time.monotonic() - started, 1)
    print_summary(results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serving-{stamp}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
