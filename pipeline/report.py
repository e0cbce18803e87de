"""`reports/<recipe>/report.md` with the acceleration table, and the two plots beside it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.cascade import CASCADE
from pipeline.profile import SCREEN_SHARE, Batching, ProfilePoint, best_point, servable
from pipeline.recipe import Recipe
from pipeline.tuning import HELD_OUT, Candidate
from serving.cpu import describe_cpu
from serving.host import OtherLoad

if TYPE_CHECKING:
    from pipeline.build import BuildResult, StepTime

HEADER = (
    "| variant | engine | precision | size MB | p50 @ batch 1 (ms) | throughput @ best batch, 2 × p99 ≤ SLO (rows/s) "
    "| × vs PyTorch eager | × vs ONNX FP32 | metric (held-out) | drop (95 % bound) | perturbed: drop (bound) "
    "| accepted (why not) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def _batch1(points: list[ProfilePoint]) -> str:
    return next((f"{p.p50_ms:.1f}" for p in points if p.batch_size == 1), "-")


def _headline_metric(recipe: Recipe) -> str:
    return next(iter(recipe.budget.max_drop)) if recipe.budget else "-"


def _drop_text(candidate: Candidate, slice_name: str, metric: str) -> str:
    figures = candidate.slices.get(slice_name)
    if figures is None or metric not in figures.drops:
        return "-"
    if candidate.reason == "reference":
        return f"reference ({figures.size} inputs)"
    return f"{figures.drops[metric]:.4f} ({figures.drop_bounds[metric]:.4f})"


def table(recipe: Recipe, candidates: list[Candidate], eager: list[ProfilePoint]) -> str:
    """Speeds at each one's best batch among those its batching may choose, as selection compares them."""
    metric = _headline_metric(recipe)

    def best(points: list[ProfilePoint]) -> ProfilePoint:
        return best_point(servable(points, recipe.slo_ms) or points[:1])

    fp32 = best(candidates[0].profile).throughput
    eager_best = best(eager)
    rows = [
        f"| PyTorch eager | torch | fp32 | - | {_batch1(eager)} "
        f"| {eager_best.throughput:.1f} @ {eager_best.batch_size} | 1.00 | {eager_best.throughput / fp32:.2f} "
        "| - | - | - | reference for speed |"
    ]
    for c in candidates:
        if c.profile:
            point = best(c.profile)
            screened = " (screened)" if 0 < c.profile_seconds < recipe.profiling.seconds_per_point else ""
            speed = f"{point.throughput:.1f} @ {point.batch_size}{screened}"
            ratios = f"{point.throughput / eager_best.throughput:.2f} | {point.throughput / fp32:.2f}"
        else:
            speed, ratios = "-", "- | -"
        value = f"{c.metrics[metric]:.4f}" if metric in c.metrics else "-"
        verdict = "yes" if c.accepted else f"no ({c.reason})"
        slices = [_drop_text(c, name, metric) for name in (HELD_OUT, "perturbed")]
        size = f"{c.size_mb:.1f}" if c.size_mb else "-"  # none: never built, or not kept
        rows.append(
            f"| {c.variant} | {c.engine} | {c.precision} | {size} | {_batch1(c.profile)} | {speed} | {ratios} "
            f"| {metric} {value} | {' | '.join(slices)} | {verdict} |"
        )
    return HEADER + "\n".join(rows) + "\n"


def batching_text(recipe: Recipe, batching: Batching) -> str:
    """The caps the profile chose and why, and which of them the recipe overrides."""
    tokens = "" if batching.max_batch_tokens is None else f", `max_batch_tokens` {batching.max_batch_tokens}"
    text = (
        f"Batching: `max_batch_size` {batching.max_batch_size}{tokens}, `max_latency_ms` "
        f"{batching.max_latency_ms}; chosen from the served variant's profile: {batching.reason}."
    )
    caps = recipe.serving.model_dump(include={"max_batch_size", "max_batch_tokens", "max_latency_ms"})
    overrides = [f"`serving.{field}` {value}" for field, value in caps.items() if value is not None]
    return text + (f" The recipe overrides {', '.join(overrides)}; the manifest serves those." if overrides else "")


def profile_table(points: list[ProfilePoint]) -> str:
    """Per batch size of the served variant: latency per call and rows/s, for text the padded
    tokens per call (length groups included) and tokens/s, the figures the caps are chosen from,
    and the engine's working memory, which the row cap sets."""
    columns = ["batch", "p50 (ms)", "p99 (ms)", "rows/s"]
    text = all(p.mean_tokens is not None for p in points)
    if text:
        columns += ["padded tokens per call (mean / max)", "tokens/s"]
    memory = all(p.memory_mib is not None for p in points)
    if memory:
        columns.append("engine memory (MiB)")
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for p in points:
        cells = [str(p.batch_size), f"{p.p50_ms:.1f}", f"{p.p99_ms:.1f}", f"{p.throughput:.1f}"]
        if text:
            cells += [f"{p.mean_tokens:.0f} / {p.max_tokens}", f"{p.tokens_per_s:.0f}"]
        if memory:
            cells.append(f"{p.memory_mib:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    """matplotlib's pyplot on its file-only backend: build machines have no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)


def plot_frontier(recipe: Recipe, candidates: list[Candidate], path: Path) -> None:
    plt = _pyplot()

    metric = _headline_metric(recipe)
    figure, axes = plt.subplots(figsize=(6, 4))
    for c in candidates:
        if c.profile and metric in c.metrics:
            axes.scatter(best_point(c.profile).throughput, c.metrics[metric], marker="o" if c.accepted else "x")
            axes.annotate(c.variant, (best_point(c.profile).throughput, c.metrics[metric]), fontsize=8)
    axes.set_xlabel("throughput at best batch (rows/s)")
    axes.set_ylabel(metric)
    axes.set_title(f"{recipe.name}: accuracy against speed")
    _save(figure, path)


def plot_latency(recipe: Recipe, candidates: list[Candidate], eager: list[ProfilePoint], path: Path) -> None:
    plt = _pyplot()

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
    _save(figure, path)


def cascade_text(candidates: list[Candidate]) -> str:
    """A cascade's threshold, who answers how much of each slice, and what it keeps of the teacher."""
    cascade = next((c for c in candidates if c.variant == CASCADE), None)
    if cascade is None:
        return ""
    if cascade.cascade is None:
        return f"## Cascade\n\n{cascade.reason}\n\n"
    teacher = next(c for c in candidates if c.variant == cascade.config["teacher"])
    speed = best_point(cascade.profile).throughput / best_point(teacher.profile).throughput if cascade.profile else 0
    rows = "\n".join(
        f"| {name} | {share:.4f} | {cascade.slices[name].metrics['top1_agreement']:.4f} "
        f"| {cascade.slices[name].drop_bounds['top1_agreement']:.4f} |"
        for name, share in cascade.config["student_share"].items()
    )
    return (
        f"## Cascade\n\n{cascade.config['student']} answers where its top probability is at least "
        f"{cascade.cascade.threshold:.4f} (calibrated on rows no slice holds), {teacher.variant} the rest: "
        f"{speed:.2f} × {teacher.variant}'s throughput at the best batch.\n\n"
        "| slice | answered by the student | top-1 agreement with the teacher | disagreement (95 % bound) |\n"
        f"|---|---|---|---|\n{rows}\n\n"
    )


def steps_text(steps: list[StepTime]) -> str:
    """Where the time of the build that made the model went (registering it aside); nothing for a
    model stored before builds were timed."""
    if not steps:
        return ""
    total = sum(seconds for _, seconds in steps)
    rows = "\n".join(f"| {name} | {seconds:.1f} | {100 * seconds / total:.0f} % |" for name, seconds in steps)
    heading = f"## Where the build's {total:.0f} s went (before registering)"
    return f"{heading}\n\n| step | seconds | share |\n|---|---:|---:|\n{rows}\n\n"


def load_text(load: OtherLoad | None) -> str:
    if load is None:
        return "other work on it not measured"
    text = f"{load.describe()} while it profiled"
    if load.too_busy:
        return text + ": **too busy for a faithful profile; rebuild on a quiet machine with `--force`**"
    return text


def data_text(judged_on: str) -> str:
    """Which data calibrated and judged the variants; nothing for a model stored before builds said."""
    return f"Calibrated and judged on {judged_on}.\n\n" if judged_on else ""


def write_report(recipe: Recipe, result: BuildResult, directory: Path) -> Path:
    candidates, eager = result.candidates, result.eager
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
    served = result.model.info.labels["variant"]
    (served_profile,) = [c.profile for c in candidates if c.variant == served]
    text = (
        f"# {recipe.name}\n\n{recipe.description}\n\nServed: `{result.model.tag}` ({served}). "
        f"{batching_text(recipe, result.batching)}\n\n"
        f"{table(recipe, candidates, eager)}\n"
        f"Profiled on this machine ({describe_cpu()}; {load_text(result.load)}) through the serving runtime, "
        "each variant on its "
        "engine with all cores, on batches drawn at random from real inputs; throughput is rows per "
        "second over all timed calls. Every variant and PyTorch eager were screened together in short "
        f"interleaved blocks ({recipe.profiling.seconds_per_point * SCREEN_SHARE:g} s per batch size); FP32 "
        "and the variants that could be served were then timed together for the recipe's "
        f"{recipe.profiling.seconds_per_point:g} s per batch size, and the rest keep their screened figures. "
        "Metrics are measured against the FP32 ONNX model on ONNX Runtime, on "
        "held-out inputs and on perturbed ones (shifted, rotated, blurred, noisy), and the gate holds each "
        "drop's one-sided 95 % upper confidence bound (in brackets) to the budget, taken over sources as "
        "well as over inputs where inputs share one (the views of a photo, the moved copies of a digit).\n\n"
        f"{data_text(result.judged_on)}"
        f"## Profile of the served variant ({served})\n\n{profile_table(served_profile)}\n"
        f"{cascade_text(candidates)}"
        f"{steps_text(result.steps)}"
        f"## Tuning trials\n\n{trials or 'none'}\n\n"
        "![accuracy against throughput](frontier.png)\n\n![latency against batch size](latency.png)\n"
    )
    path = directory / "report.md"
    path.write_text(text)
    return path
