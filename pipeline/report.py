"""`reports/<recipe>/report.md` with the acceleration table, and the two plots beside it."""

from __future__ import annotations

from pathlib import Path

from pipeline.profile import ProfilePoint, best_point
from pipeline.recipe import Recipe
from pipeline.tuning import Candidate

HEADER = (
    "| variant | precision | size MB | p50 @ batch 1 (ms) | throughput @ best batch (rows/s) | × vs PyTorch eager "
    "| × vs ONNX FP32 | metric | drop | accepted (why not) |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
)


def _batch1(points: list[ProfilePoint]) -> str:
    return next((f"{p.p50_ms:.1f}" for p in points if p.batch_size == 1), "-")


def _headline_metric(recipe: Recipe) -> str:
    return next(iter(recipe.budget.max_drop)) if recipe.budget else "-"


def table(recipe: Recipe, candidates: list[Candidate], eager: list[ProfilePoint]) -> str:
    metric = _headline_metric(recipe)
    fp32 = best_point(candidates[0].profile).throughput
    eager_best = best_point(eager)
    rows = [
        f"| PyTorch eager | fp32 | - | {_batch1(eager)} | {eager_best.throughput:.1f} @ {eager_best.batch_size} "
        f"| 1.00 | {eager_best.throughput / fp32:.2f} | - | - | reference for speed |"
    ]
    for c in candidates:
        if c.profile:
            best = best_point(c.profile)
            speed = f"{best.throughput:.1f} @ {best.batch_size}"
            ratios = f"{best.throughput / eager_best.throughput:.2f} | {best.throughput / fp32:.2f}"
        else:
            speed, ratios = "-", "- | -"
        value = f"{c.metrics[metric]:.4f}" if metric in c.metrics else "-"
        drop = f"{c.drops[metric]:.4f}" if metric in c.drops else "-"
        verdict = "yes" if c.accepted else f"no ({c.reason})"
        rows.append(
            f"| {c.variant} | {c.precision} | {c.size_mb:.1f} | {_batch1(c.profile)} | {speed} | {ratios} "
            f"| {metric} {value} | {drop} | {verdict} |"
        )
    return HEADER + "\n".join(rows) + "\n"


def plot_frontier(recipe: Recipe, candidates: list[Candidate], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = _headline_metric(recipe)
    figure, axes = plt.subplots(figsize=(6, 4))
    for c in candidates:
        if c.profile and metric in c.metrics:
            axes.scatter(best_point(c.profile).throughput, c.metrics[metric], marker="o" if c.accepted else "x")
            axes.annotate(c.variant, (best_point(c.profile).throughput, c.metrics[metric]), fontsize=8)
    axes.set_xlabel("throughput at best batch (rows/s)")
    axes.set_ylabel(metric)
    axes.set_title(f"{recipe.name}: accuracy against speed")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_latency(recipe: Recipe, candidates: list[Candidate], eager: list[ProfilePoint], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    series = [("PyTorch eager", eager)] + [(c.variant, c.profile) for c in candidates if c.profile]
    for label, points in series:
        axes.plot([p.batch_size for p in points], [p.p50_ms for p in points], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("batch size")
    axes.set_ylabel("p50 latency per call (ms)")
    axes.set_title(f"{recipe.name}: latency against batch size")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(
    recipe: Recipe, candidates: list[Candidate], eager: list[ProfilePoint], served: str, batching: str, directory: Path
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    plot_frontier(recipe, candidates, directory / "frontier.png")
    plot_latency(recipe, candidates, eager, directory / "latency.png")
    trials = "\n".join(
        f"- **{c.variant}**: "
        + "; ".join(
            f"{t.config or 'default'} → " + (t.error or ("ok" if not t.failed else ", ".join(t.failed)))
            for t in c.trials
        )
        for c in candidates
        if c.trials
    )
    text = (
        f"# {recipe.name}\n\n{recipe.description}\n\nServed: `{served}`. Batching: {batching}.\n\n"
        f"{table(recipe, candidates, eager)}\n"
        "Throughput is rows per second of one model call on this machine (ONNX Runtime, all cores); "
        "metrics are measured on held-out data against the FP32 ONNX model.\n\n"
        f"## Tuning trials\n\n{trials or 'none'}\n\n"
        "![accuracy against throughput](frontier.png)\n\n![latency against batch size](latency.png)\n"
    )
    path = directory / "report.md"
    path.write_text(text)
    return path
