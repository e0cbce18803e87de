"""The sweep as a rich table, a JSON document and two PNG plots."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.capacity import PLATEAU_SHARE
from loadtest.sweep import SweepResult


def to_json(result: SweepResult) -> dict[str, Any]:
    document = dataclasses.asdict(result)
    document["settings"]["scrape_url"] = result.settings.scrape_url
    return {"tool": "optiserve loadtest", **document}


def write_json(result: SweepResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=2) + "\n")
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(result: SweepResult) -> Table:
    level_name = "concurrency" if result.settings.mode == "concurrency" else "rate /s"
    out = Table(title=f"{result.settings.url}  (SLO p99 {result.settings.slo_ms:g} ms)")
    for column in (level_name, "req/s", "rows/s", "p50", "p90", "p95", "p99", "errors", "windows"):
        out.add_column(column, justify="right")
    for column in ("queue ms", "infer ms", "batch rows", "model svc ms", "front ms", "workers MiB"):
        out.add_column(column, justify="right", style="cyan")
    for level in result.levels:
        r, latency, server = level.result, level.result.latency_ms, level.server
        errors = ", ".join(f"{k}×{v}" for k, v in r.errors.items()) or "0"
        out.add_row(
            f"{level.level:g}",
            f"{r.throughput:.1f}",
            f"{r.rows_per_s:.1f}",
            *(_ms(getattr(latency, q, None)) for q in ("p50", "p90", "p95", "p99")),
            errors,
            f"{len(level.windows)}{'' if level.stable else ' (unstable)'}",
            _ms(server.queue_ms if server else None),
            _ms(server.inference_ms if server else None),
            _ms(server.batch_rows if server else None),
            _ms(server.model_service_ms if server else None),
            _ms(server.front_ms if server else None),
            _mib(server.workers_mib if server else None),
        )
    return out


def print_report(result: SweepResult, console: Console) -> None:
    console.print(table(result))
    console.print(f"sweep: {result.stopped}")
    knee = result.knee
    if knee is None:
        console.print(f"[red]no level met p99 ≤ {result.settings.slo_ms:g} ms without errors: no knee[/red]")
        return
    console.print(
        f"knee: {knee.throughput:.1f} req/s at level {knee.level:g} (p99 {knee.p99_ms:.1f} ms ≤ SLO "
        f"{knee.slo_ms:g} ms); within {PLATEAU_SHARE:.0%} of it from level {knee.saturated_at:g}"
        f" to {knee.plateau_end:g}"
    )
    plan = result.capacity_plan
    if plan is not None:
        console.print(
            f"capacity plan: {plan.target_qps:g} req/s at p99 ≤ {knee.slo_ms:g} ms needs [bold]{plan.replicas}[/bold] "
            f"replica(s) of this one, each planned at {plan.planned_per_replica_qps:.1f} req/s "
            f"({plan.headroom:.0%} headroom off its {plan.knee_qps:.1f} req/s knee); "
            f"fleet utilization at target {plan.utilization:.0%}"
        )
        if plan.replica_mib is not None:
            console.print(
                f"memory: each replica's workers held {plan.replica_mib:.0f} MiB at the knee, "
                f"{plan.fleet_mib:.0f} MiB for {plan.replicas}"
            )


def pyplot() -> Any:
    """matplotlib's pyplot on its file-only backend: servers and CI have no display."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot().close(figure)
    return path


def write_plots(result: SweepResult, folder: Path, stem: str) -> list[Path]:
    """Throughput against load level, and p99 against throughput with the SLO line."""
    plt = pyplot()

    folder.mkdir(parents=True, exist_ok=True)
    levels = [lv.level for lv in result.levels]
    throughput = [lv.result.throughput for lv in result.levels]
    p99 = [lv.result.latency_ms.p99 if lv.result.latency_ms else float("nan") for lv in result.levels]
    level_name = "concurrency" if result.settings.mode == "concurrency" else "offered rate (req/s)"
    paths = []

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(levels, throughput, marker="o")
    if result.settings.mode == "concurrency":
        axes.set_xscale("log", base=2)
    axes.set(xlabel=level_name, ylabel="throughput (req/s)", title=f"throughput vs {level_name}")
    axes.grid(alpha=0.3)
    paths.append(save_figure(figure, folder / f"{stem}-throughput.png"))

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(throughput, p99, marker="o")
    for x, y, level in zip(throughput, p99, levels, strict=True):
        axes.annotate(f"{level:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.axhline(result.settings.slo_ms, color="red", linestyle="--", label=f"SLO {result.settings.slo_ms:g} ms")
    if result.knee is not None:
        axes.scatter([result.knee.throughput], [result.knee.p99_ms], s=120, facecolors="none", edgecolors="green")
    axes.set(xlabel="throughput (req/s)", ylabel="p99 latency (ms)", title="p99 vs throughput")
    axes.legend()
    axes.grid(alpha=0.3)
    paths.append(save_figure(figure, folder / f"{stem}-p99.png"))
    return paths
