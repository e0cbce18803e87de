"""`python -m pipeline models/*.yaml`: build every recipe and write the serving manifest."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.build import StepTime, build
from pipeline.export_check import ExportCheckError
from pipeline.own_data import check_data
from pipeline.profile import Batching
from pipeline.quiet import third_party_quiet
from pipeline.recipe import LoadedRecipe, RecipeError, load_recipe
from pipeline.report import write_report
from serving.manifest import DEFAULT_ENDPOINTS, ManifestError, manifest_path, update_manifest

console = Console(stderr=True, width=160)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    parser.add_argument("recipes", nargs="+", type=Path, help="recipe files (models/*.yaml)")
    parser.add_argument(
        "--manifest",
        type=Path,
        default=manifest_path(),
        help="manifest to write (default: what `bentoml serve` reads, $OPTISERVE_MANIFEST or the project's "
        "serving-manifest.json)",
    )
    parser.add_argument("--reports", type=Path, default=Path("reports"), help="where report.md and plots go")
    parser.add_argument("--force", action="store_true", help="rebuild even when the store has this recipe")
    return parser.parse_args(argv)


def load_all(paths: list[Path]) -> list[LoadedRecipe]:
    """Validate every recipe, and the data it names, before any slow work, so a typo in the last
    one fails in a second."""
    loaded = [load_recipe(path) for path in paths]
    seen: dict[str, Path] = {}
    names: dict[str, Path] = {}
    for item in loaded:
        if item.name in names:
            raise RecipeError(f"{item.path}: name: {item.name!r} is also the name in {names[item.name]}")
        names[item.name] = item.path
        endpoint = item.recipe.serving.endpoint
        if endpoint is not None and endpoint in seen:
            raise RecipeError(f"{item.path}: serving.endpoint: {endpoint!r} is already served by {seen[endpoint]}")
        if endpoint is None and item.name in DEFAULT_ENDPOINTS:
            raise RecipeError(f"{item.path}: name: {item.name!r} is a default endpoint's; name the model otherwise")
        if endpoint is not None:
            seen[endpoint] = item.path
    for item in loaded:  # last: decoding every image of a data folder takes a while
        check_data(item)
    return loaded


def check_writable(manifest: Path) -> None:
    """The manifest can be written once the builds are done: found out now, not after them."""
    if manifest.is_dir() or not manifest.parent.is_dir():
        raise RecipeError(f"--manifest {manifest}: not a file in an existing folder")


def batching_summary(batching: Batching) -> str:
    tokens = "" if batching.max_batch_tokens is None else f", {batching.max_batch_tokens} tokens"
    return f"{batching.max_batch_size} rows{tokens}, {batching.max_latency_ms} ms"


def slowest_steps(name: str, steps: list[StepTime], shown: int = 3) -> str:
    """A build's slowest steps, on one line under the summary table; a step's name without its
    details after the colon (the variants a profiling step timed), which the report lists."""
    slowest = sorted(steps, key=lambda step: -step.seconds)[:shown]
    return f"{name}: " + ", ".join(f"{step.name.split(':')[0]} {step.seconds:.0f} s" for step in slowest)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        recipes = load_all(args.recipes)
        check_writable(args.manifest)
    except RecipeError as exc:
        console.print(f"[red]recipe error[/red] {escape(str(exc))}", soft_wrap=True)
        return 2
    routes, slowest = {}, []
    table = Table("recipe", "served", "built", "variants accepted", "batching", "report", "seconds")
    with (
        third_party_quiet(console),
        Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console
        ) as progress,
    ):
        overall = progress.add_task("recipes", total=len(recipes))
        for loaded in recipes:
            started = time.monotonic()
            task = progress.add_task(loaded.name, total=None)
            try:
                result = build(
                    loaded,
                    step=lambda text, t=task, n=loaded.name: progress.update(t, description=f"{n}: {text}"),
                    force=args.force,
                )
            except (RecipeError, ExportCheckError) as exc:
                progress.stop()
                console.print(f"[red]{loaded.name} failed[/red]\n{escape(str(exc))}", soft_wrap=True)
                return 1
            progress.update(task, description=f"{loaded.name}: done", total=1, completed=1)
            progress.advance(overall)
            routes[loaded.recipe.serving.endpoint or loaded.name] = result.route(loaded)
            report = write_report(loaded.recipe, result, args.reports / loaded.name)
            table.add_row(
                loaded.name,
                f"{result.model.tag} ({result.model.info.labels['variant']})",
                "reused" if result.reused else "new",
                ", ".join(c.variant for c in result.candidates if c.accepted),
                batching_summary(result.batching),
                str(report),
                f"{time.monotonic() - started:.1f}",
            )
            if result.steps and not result.reused:
                slowest.append(slowest_steps(loaded.name, result.steps))
    console.print(table)
    if slowest:
        console.print("slowest steps (each report lists them all):\n  " + "\n  ".join(slowest))
    try:
        manifest = update_manifest(routes, args.manifest)
    except ManifestError as exc:
        console.print(f"[red]serving manifest not updated[/red] {escape(str(exc))}", soft_wrap=True)
        return 1
    served = ", ".join(f"{name} → {route.tag}" for name, route in manifest.routes().items()) or "no model"
    console.print(f"serving manifest: {args.manifest} ({served})")
    return 0
