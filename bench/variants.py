"""`python -m bench.variants NAME…`: the variants' speed-ups over FP32 at the batch the targets name.

`make optimize` reports each variant's best throughput at whatever batch size suits it; the
optimization targets are stated at batch 32 (text: 128 tokens). This measures exactly that,
for every variant that one pipeline run registered for a model (the run of the stored model
named, default its latest), interleaved in blocks so that the ratios share the machine's
noise, and prints the table and writes JSON to reports/bench/.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="stored model name or tag, e.g. text-embedder or text-embedder:abc")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sequence-length", type=int, default=128, help="tokens per text row")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per variant")
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "bench")
    return parser.parse_args(argv)


def sibling_variants(reference) -> list:
    """The models registered by the same pipeline run as `reference`, FP32 first."""
    import bentoml

    from pipeline.registry import RECIPE_HASH

    run = reference.info.metadata.get(RECIPE_HASH)
    found = [m for m in bentoml.models.list(reference.tag.name) if m.info.metadata.get(RECIPE_HASH) == run]
    return sorted(found, key=lambda m: (m.info.labels.get("variant") != "fp32", m.info.labels.get("variant", "")))


def synthetic_feeds(model, sequence_length: int):
    """Feeds for a batch size: random pixels, or rows of `sequence_length` tokens."""
    from serving.model_runtime import read_spec
    from serving.text import pad_batch

    spec = read_spec(model.info.metadata)
    if spec.image is not None:
        size, name = spec.image.size, spec.input_names[0]
        pixels = np.random.default_rng(0).integers(0, 256, (1, size, size, 3), np.uint8)
        return lambda batch: {name: np.repeat(pixels, batch, axis=0)}
    return lambda batch: pad_batch([[1] * sequence_length] * batch, spec.text.pad_token_id)


def measure(name: str, args: argparse.Namespace) -> list[dict]:
    import bentoml

    from pipeline.profile import engine_runner, time_interleaved
    from serving.cpu import isa_flags
    from serving.engine import EngineSettings
    from serving.model_runtime import engine_of
    from serving.model_spec import ONNX_FILE

    variants = {m.info.labels["variant"]: m for m in sibling_variants(bentoml.models.get(name))}
    settings = EngineSettings.from_environment()
    runners = {
        variant: engine_runner(
            Path(model.path) / ONNX_FILE, synthetic_feeds(model, args.sequence_length), settings, engine_of(model)
        )
        for variant, model in variants.items()
    }
    print(f"{name}: timing {', '.join(runners)} at batch {args.batch} …", file=sys.stderr)
    points = time_interleaved(runners, args.batch, seconds=args.seconds, blocks=8)
    fp32 = points["fp32"].p50_ms
    # Each engine's own FP32: the export itself for ONNX Runtime, the `openvino` variant for OpenVINO.
    openvino = points["openvino"].p50_ms if "openvino" in points else None
    engine_fp32 = {"onnxruntime": fp32, "openvino": openvino, "openvino-bf16": openvino}
    return [
        {
            "model": str(model.tag),
            "variant": variant,
            "engine": engine_of(model),
            "precision": model.info.labels.get("precision"),
            "batch": args.batch,
            "p50_ms": points[variant].p50_ms,
            "rows_per_s": points[variant].throughput,
            "speedup_vs_fp32": fp32 / points[variant].p50_ms,
            "speedup_vs_engine_fp32": (own / points[variant].p50_ms)
            if (own := engine_fp32[engine_of(model)])
            else None,
            "isa": list(isa_flags()),
            "evaluation": model.info.metadata.get("evaluation"),
        }
        for variant, model in variants.items()
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from rich.console import Console
    from rich.table import Table

    from pipeline.host_load import cpu_clock, other_load
    from serving.cpu import describe_cpu
    from serving.host import this_host

    started = cpu_clock()
    rows = [row for name in args.models for row in measure(name, args)]
    load = other_load(started, cpu_clock())
    table = Table(
        title=f"variants against FP32 at batch {args.batch} (text rows: {args.sequence_length} tokens)",
        caption=f"{describe_cpu()}; {load.describe() if load else 'other work not measured'}",
    )
    for column in ("model", "variant", "engine", "precision", "p50 ms", "rows/s", "× ORT FP32", "× engine's FP32"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["model"],
            row["variant"],
            row["engine"],
            row["precision"] or "-",
            f"{row['p50_ms']:.1f}",
            f"{row['rows_per_s']:.1f}",
            f"{row['speedup_vs_fp32']:.2f}",
            "-" if row["speedup_vs_engine_fp32"] is None else f"{row['speedup_vs_engine_fp32']:.2f}",
        )
    Console(width=140).print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"variants-{datetime.now():%Y%m%d-%H%M%S}.json"
    run = {
        "settings": vars(args) | {"out": str(args.out)},
        "machine": this_host().model_dump(),
        "other_work": load.model_dump() if load else None,
        "rows": rows,
    }
    path.write_text(json.dumps(run, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
