"""`python -m loadtest [URL] ...`: sweep a running server and report table, JSON and plots.

Examples:
    python -m loadtest http://127.0.0.1:3000/classify --slo-ms 300 --target-qps 200
    python -m loadtest http://127.0.0.1:3000/embed --texts my-texts.txt --mode rate --rates 5,10,20,40
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import uvloop
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.inputs import (
    InputError,
    Payload,
    default_texts,
    image_payloads,
    read_image_folder,
    read_texts,
    text_payloads,
    write_sample_photos,
)
from loadtest.report import print_report, write_json, write_plots
from loadtest.stats import Summary
from loadtest.sweep import CONCURRENCY_LEVELS, SweepSettings, sweep

DEFAULT_URL = "http://127.0.0.1:3000/classify"


def numbers(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"endpoint to load (default {DEFAULT_URL})")
    inputs = parser.add_argument_group("inputs (default: the project's sample photos or texts)")
    inputs.add_argument("--input", choices=("auto", "image", "text"), default="auto", help="auto: text for */embed*")
    inputs.add_argument("--images", type=Path, help="folder of image files")
    inputs.add_argument("--texts", type=Path, help="text file, one text per line")
    inputs.add_argument("--items-per-request", type=int, default=1, help="images (multipart) or texts per request")
    inputs.add_argument(
        "--multipart-field", help="send images as multipart under this field (default: raw; 'images' for *_batch)"
    )
    load = parser.add_argument_group("load")
    load.add_argument("--mode", choices=("concurrency", "rate"), default="concurrency")
    load.add_argument("--concurrency", type=numbers, default=CONCURRENCY_LEVELS, help="levels, e.g. 1,2,4,8")
    load.add_argument("--rates", type=numbers, default=(2, 5, 10, 20, 40), help="Poisson arrival rates per second")
    load.add_argument("--all-levels", action="store_true", help="keep going past the first level over the SLO")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each level's windows")
    measure.add_argument("--window", type=float, default=3.0, help="seconds per measurement window")
    measure.add_argument("--stable-windows", type=int, default=3, help="windows that must agree")
    measure.add_argument("--tolerance", type=float, default=0.10, help="allowed spread around their mean")
    measure.add_argument("--max-windows", type=int, default=8, help="windows per level at most")
    measure.add_argument("--max-duration", type=float, default=600.0, help="seconds for the whole sweep at most")
    measure.add_argument("--timeout", type=float, default=30.0, help="seconds per request before it counts as failed")
    measure.add_argument("--metrics-url", help="Prometheus page to scrape (default <origin>/metrics)")
    measure.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    plan = parser.add_argument_group("knee and capacity plan")
    plan.add_argument("--slo-ms", type=float, default=500.0, help="p99 latency objective")
    plan.add_argument("--max-error-rate", type=float, default=0.0, help="error share a level may have and still count")
    plan.add_argument("--target-qps", type=float, help="plan replicas for this many requests per second")
    plan.add_argument("--headroom", type=float, default=0.3, help="share of each replica's knee kept spare")
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("reports/loadtest"), help="folder for JSON and plots")
    output.add_argument("--name", help="file stem (default: loadtest-<time>)")
    output.add_argument("--no-plots", action="store_true")
    return parser.parse_args(argv)


def build_payloads(args: argparse.Namespace) -> tuple[list[Payload], dict[str, object]]:
    path = urlsplit(args.url).path
    kind = args.input
    if kind == "auto":
        kind = "text" if args.texts is not None or "embed" in path else "image"
    if kind == "text":
        texts = read_texts(args.texts) if args.texts else default_texts()
        source = str(args.texts) if args.texts else "sample_inputs.sample_texts()"
        payloads = text_payloads(texts, per_request=args.items_per_request)
        return payloads, {"kind": "text", "source": source, "items": len(texts), "per_request": args.items_per_request}
    folder = args.images or write_sample_photos()
    field = args.multipart_field or ("images" if path.rstrip("/").endswith("_batch") else None)
    files = read_image_folder(folder)
    payloads = image_payloads(files, multipart_field=field, per_request=args.items_per_request)
    source = str(args.images) if args.images else f"sample_inputs.sample_photos() in {folder}"
    return payloads, {
        "kind": "image",
        "source": source,
        "items": len(files),
        "per_request": args.items_per_request,
        "multipart_field": field,
    }


def settings_from(args: argparse.Namespace) -> SweepSettings:
    return SweepSettings(
        url=args.url,
        mode=args.mode,
        levels=args.concurrency if args.mode == "concurrency" else args.rates,
        slo_ms=args.slo_ms,
        warmup_s=args.warmup,
        window_s=args.window,
        stable_windows=args.stable_windows,
        max_windows=args.max_windows,
        tolerance=args.tolerance,
        max_duration_s=args.max_duration,
        request_timeout_s=args.timeout,
        metrics_url="" if args.no_metrics else args.metrics_url,
        stop_past_slo=not args.all_levels,
        max_error_rate=args.max_error_rate,
        target_qps=args.target_qps,
        headroom=args.headroom,
    )


async def sweep_with_progress(settings: SweepSettings, payloads: list[Payload], inputs: dict, console: Console):
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[figure]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        overall = progress.add_task("levels", total=len(settings.levels), figure="")
        current: dict[str, object] = {}

        def on_level(level: float) -> None:
            if "task" in current:
                progress.remove_task(current["task"])  # type: ignore[arg-type]
                progress.advance(overall)
            current["task"] = progress.add_task(f"{settings.mode} {level:g}", total=settings.max_windows, figure="")

        def on_window(level: float, index: int, window: Summary) -> None:
            p99 = f"{window.latency_ms.p99:.0f} ms" if window.latency_ms else "-"
            figure = f"window {index}: {window.throughput:.1f} req/s, p99 {p99}"
            progress.update(current["task"], advance=1, figure=figure)  # type: ignore[arg-type]

        result = await sweep(settings, payloads, inputs, on_level=on_level, on_window=on_window)
        progress.update(overall, completed=len(settings.levels))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=True)
    try:
        settings = settings_from(args)
        payloads, inputs = build_payloads(args)
    except (InputError, ValueError) as exc:
        console.print(f"[red]loadtest:[/red] {exc}")
        return 2
    console.print(f"loading {settings.url} with {len(payloads)} distinct {inputs['kind']} request bodies")
    result = uvloop.run(sweep_with_progress(settings, payloads, inputs, console))
    out = Console()
    print_report(result, out if out.is_terminal else Console(width=160))
    stem = args.name or f"loadtest-{datetime.now():%Y%m%d-%H%M%S}"
    written = [write_json(result, args.out / f"{stem}.json")]
    if not args.no_plots and result.levels:
        written += write_plots(result, args.out, stem)
    console.print("wrote " + ", ".join(str(p) for p in written))
    if not result.levels:
        console.print(f"[red]loadtest:[/red] nothing measured: {result.stopped}")
        return 1
    if not any(level.result.ok for level in result.levels):
        errors: Counter[str] = Counter()
        for level in result.levels:
            errors.update(level.result.errors)
        said = ", ".join(f"{status} × {count}" for status, count in errors.most_common()) or "nothing answered"
        console.print(f"[red]loadtest:[/red] no request succeeded: {said}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
