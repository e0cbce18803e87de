"""One recipe end to end: source → ONNX FP32 → checked → variants tuned against the budget →
profiled → served variant selected → every accepted artifact in the model store → report."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import bentoml
import numpy as np
import onnx
import torch

from pipeline.cascade import CASCADE, OutputsOn, cascade_candidate
from pipeline.datasets import Split
from pipeline.evaluate import run_batched
from pipeline.export import ServingGraph, export_onnx
from pipeline.export_check import check_export
from pipeline.host_load import cpu_clock, other_load
from pipeline.profile import (
    FULL_BLOCKS,
    NOISE_MARGIN,
    SCREEN_BLOCKS,
    SCREEN_SHARE,
    Batching,
    ProfilePoint,
    Run,
    choose_batching,
    profile,
    runtime_runner,
    sampler,
    servable,
)
from pipeline.recipe import LoadedRecipe, Recipe
from pipeline.registry import RECIPE_HASH, find_selected, register
from pipeline.sources import load_source
from pipeline.tasks import TASKS, PipelineTask, TaskData
from pipeline.tuning import HELD_OUT, Candidate, Predict, judge_slices, tune
from pipeline.variants import KINDS, VariantInputs
from pipeline.working_memory import working_memory
from serving.engine import ENGINE_LABEL, Engine, EngineName, EngineSettings, available_providers, open_engine
from serving.host import PROFILE_LOAD, PROFILED_ON, OtherLoad, profiled_elsewhere, this_host
from serving.manifest import Route
from serving.model_runtime import onnx_runtime
from serving.model_spec import ONNX_FILE, SPEC_KEY, TEACHER_FILE, ModelSpec
from serving.monitoring import MONITORING_KEY

# Bump when export or registration changes what an unchanged recipe produces.
EXPORT_REVISION = "6"
Step = Callable[[str], None]
BUILD_STEPS = "build_steps"  # the selected variant's metadata: the steps of the build that made it
JUDGED_ON = "judged_on"  # every variant's metadata: which data calibrated and judged it
EAGER = "pytorch-eager"
log = logging.getLogger(__name__)


class StepTime(NamedTuple):
    name: str
    seconds: float


class StepClock:
    """Shows each step of a build as it starts (`show`, the progress bar) and keeps how long each
    took, so that the report can say where the minutes of `make serve` went on this machine. A
    step ends when the next starts: the last one, registration, is shown but not timed, since the
    times are stored with the model it registers."""

    def __init__(self, show: Step) -> None:
        self.show = show
        self.times: list[StepTime] = []
        self._current: tuple[str, float] | None = None

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        if self._current is not None:
            self.times.append(StepTime(self._current[0], now - self._current[1]))
        self.show(name)
        self._current = (name, now)


@dataclass(frozen=True)
class BuildResult:
    model: bentoml.Model  # the selected (served) variant
    batching: Batching
    candidates: list[Candidate]
    eager: list[ProfilePoint]
    reused: bool
    steps: list[StepTime] = field(default_factory=list)  # the build's, in order, also when reused
    load: OtherLoad | None = None  # other work on the machine while the variants were profiled
    judged_on: str = ""  # which data calibrated and judged the variants (TaskData.judged_on)

    def route(self, loaded: LoadedRecipe) -> Route:
        serving = loaded.recipe.serving
        return Route(
            tag=str(self.model.tag),
            recipe=loaded.recipe.name,
            alias=serving.alias,
            canary=serving.canary,
            shadow=serving.shadow,
            max_batch_size=serving.max_batch_size or self.batching.max_batch_size,
            max_batch_tokens=serving.max_batch_tokens or self.batching.max_batch_tokens,
            max_latency_ms=serving.max_latency_ms or self.batching.max_latency_ms,
            max_items_per_request=serving.max_items_per_request,
            cache_mb=serving.cache_mb,
        )


def recipe_hash(loaded: LoadedRecipe) -> str:
    return loaded.content_hash(extra=f"{EXPORT_REVISION}|torch={torch.__version__!s}|onnx={onnx.__version__}")


def _outputs(engine: Engine, data: TaskData, split: Split) -> np.ndarray:
    output = engine.output_names[0]
    return run_batched(lambda rows: engine.run(data.feeds(rows))[output], split)


def _predictor(data: TaskData, settings: EngineSettings) -> Predict:
    """A graph's outputs on every evaluation slice."""

    def predict(path: Path, engine_name: EngineName) -> dict[str, np.ndarray]:
        engine = open_engine(engine_name, path, settings)
        return {name: _outputs(engine, data, split) for name, split in data.evaluation.items()}

    return predict


def _outputs_on(data: TaskData, settings: EngineSettings) -> OutputsOn:
    """A graph's outputs on any split (a cascade's threshold split)."""
    return lambda path, engine_name, split: _outputs(open_engine(engine_name, path, settings), data, split)


def _eager_runner(task: PipelineTask, graph: ServingGraph, data: TaskData) -> Run:
    """The same drawn rows, each batch padded to its longest text as a plain PyTorch server would."""
    draw = sampler(data.profiling.rows)

    def run(batch: int) -> int | None:
        feeds = data.feeds(draw(batch))
        with torch.inference_mode():
            graph.module(*(torch.from_numpy(feeds[name]) for name in graph.input_names))
        return feeds[graph.input_names[0]].size if task.runtime.batched_by_tokens else None

    return run


# Screened within this share of the best throughput: timed again in full (`contenders`).
CONTENDER_SHARE = 0.8


def _fp16_on_cpu_only(candidate: Candidate, fp32: Candidate, slo_ms: float) -> Candidate:
    """FP16 is for GPU providers; on a CPU (ARM: x86 CPUs do not build it) it is kept only if it
    measured clearly faster than FP32, compared as selection compares variants."""
    if candidate.variant != "fp16" or not candidate.accepted or available_providers() != ["CPUExecutionProvider"]:
        return candidate
    fp16, reference = servable_throughput(candidate, slo_ms), servable_throughput(fp32, slo_ms)
    if fp16 > (1 + NOISE_MARGIN) * reference:
        return candidate
    speed = f"{fp16 / reference:.2f}× FP32 throughput" if reference else "no batch within the SLO"
    return candidate.model_copy(update={"accepted": False, "reason": f"skipped: on CPU fp16 runs at {speed}"})


def servable_throughput(candidate: Candidate, slo_ms: float) -> float:
    """Rows/s at the candidate's best batch size among those its batching may choose: variants
    are compared at the batches the service would run them in, not at larger ones it never will."""
    return max((p.throughput for p in servable(candidate.profile, slo_ms)), default=0.0)


def select(candidates: list[Candidate], slo_ms: float, preferred: str | None = None) -> Candidate:
    """The `preferred` variant where the gate accepted it (the recipe's `serving.variant`); else
    the highest throughput among accepted variants at the batch sizes their batching may choose;
    the FP32 reference stays unless another variant beats it by more than the noise margin."""
    if (named := next((c for c in candidates if c.variant == preferred and c.accepted), None)) is not None:
        return named
    reference = candidates[0]
    floor = servable_throughput(reference, slo_ms) * (1 + NOISE_MARGIN)
    faster = [c for c in candidates[1:] if c.accepted and servable_throughput(c, slo_ms) > floor]
    return max(faster, key=lambda c: servable_throughput(c, slo_ms), default=reference)


def build(loaded: LoadedRecipe, *, step: Step = lambda _: None, force: bool = False) -> BuildResult:
    content_hash = recipe_hash(loaded)
    if not force and (reused := reuse(loaded.name, content_hash)) is not None:
        return reused
    recipe = loaded.recipe
    task = TASKS[recipe.task]
    clock = StepClock(step)
    clock("loading source model")
    source = load_source(loaded)
    graph = task.serving_graph(recipe, source)
    settings = EngineSettings.from_environment()
    slo_ms = recipe.slo_ms
    with tempfile.TemporaryDirectory(prefix="optiserve-") as scratch:
        workdir = Path(scratch)
        clock("exporting to ONNX")
        fp32_path = export_onnx(graph, workdir / ONNX_FILE, opset=recipe.export.opset)
        clock("preparing calibration, evaluation and profiling inputs")
        data = task.prepare(loaded, source, graph, workdir)
        clock("checking ONNX against PyTorch")
        check = check_export(task, recipe.export.tolerance, graph, fp32_path, data.check_batches)
        config = getattr(source.module, "config", None)
        inputs = VariantInputs(
            task=task,
            fp32=fp32_path,
            workdir=workdir,
            calibration=data.calibration,
            feeds=data.feeds,
            num_heads=getattr(config, "num_attention_heads", 0),
            hidden_size=getattr(config, "hidden_size", 0),
            graph=graph,
            opset=recipe.export.opset,
            training=data.training,
            student=recipe.student,
        )
        predict = _predictor(data, settings)
        clock("evaluating FP32, the reference")
        reference = predict(inputs.fp32, "onnxruntime")
        candidates = tune_variants(recipe, inputs, data, predict, reference, clock)
        if CASCADE in recipe.variants:
            clock("variant cascade: calibrating its threshold")
            outputs_on = _outputs_on(data, settings)
            candidates.append(
                cascade_candidate(
                    task,
                    candidates,
                    data.threshold,
                    outputs_on,
                    predict,
                    reference,
                    data.evaluation,
                    recipe.budget,
                    workdir,
                )
            )
        started = cpu_clock()
        candidates, chosen, eager = profile_candidates(candidates, task, graph, data, recipe, settings, slo_ms, clock)
        load = other_load(started, cpu_clock())
        if load is not None and load.too_busy:
            log.warning(
                "%s: profiled while %s: its latencies are inflated and its batching may be too small; "
                "rebuild on a quiet machine (python -m pipeline %s --force)",
                recipe.name,
                load.describe(),
                loaded.path,
            )
        batching = choose_batching(
            chosen.profile, slo_ms=slo_ms, max_length=data.spec.text.max_length if data.spec.text else None
        )
        clock("registering in the model store")
        steps = list(clock.times)
        common = {
            RECIPE_HASH: content_hash,
            "source": recipe.source.model_dump(mode="json"),
            "export_check": check.as_metadata(),
            "versions": {"torch": str(torch.__version__), "onnx": onnx.__version__},
            JUDGED_ON: data.judged_on,
            MONITORING_KEY: task.monitoring_reference(
                HELD_OUT, data.evaluation[HELD_OUT], reference[HELD_OUT]
            ).model_dump(mode="json", exclude_none=True),
        }
        selection = {
            "batching": batching.model_dump(),
            "candidates": [c.model_dump(mode="json", exclude={"path"}) for c in candidates],
            "eager_profile": [p.model_dump() for p in eager],
            PROFILE_LOAD: load.model_dump() if load else None,
            PROFILED_ON: this_host().model_dump(),
            BUILD_STEPS: [step._asdict() for step in steps],
        }
        stored = {
            c.variant: register_candidate(
                recipe,
                c,
                data.files,
                {
                    **common,
                    SPEC_KEY: spec_of(data.spec, c).model_dump(mode="json", exclude_none=True),
                    **(selection if c is chosen else {}),
                },
                c is chosen,
            )
            for c in candidates
            if c.accepted
        }
    return BuildResult(
        stored[chosen.variant],
        batching,
        candidates,
        eager,
        reused=False,
        steps=steps,
        load=load,
        judged_on=data.judged_on,
    )


def tune_variants(
    recipe: Recipe,
    inputs: VariantInputs,
    data: TaskData,
    predict: Predict,
    reference: dict[str, np.ndarray],
    step: Step,
) -> list[Candidate]:
    """FP32 (`reference`: its outputs per evaluation slice) as the reference, then each requested
    kind tuned against the budget, in recipe order."""
    candidates = [
        Candidate(
            variant="fp32",
            precision="fp32",
            path=inputs.fp32,
            size_mb=inputs.fp32.stat().st_size / 1e6,
            slices=judge_slices(inputs.task, reference, reference, data.evaluation),
            accepted=True,
            reason="reference",
        )
    ]
    for name in (name for name in recipe.variants if name != CASCADE):  # built from the others (pipeline/cascade.py)
        step(f"variant {name}")
        candidate = tune(
            KINDS[name],
            inputs,
            predict=predict,
            reference=reference,
            evaluation=data.evaluation,
            budget=recipe.budget,
        )
        if candidate.accepted:
            inputs.built[name] = candidate.path
        candidates.append(candidate)
    return candidates


def profile_candidates(
    candidates: list[Candidate],
    task: PipelineTask,
    graph: ServingGraph,
    data: TaskData,
    recipe: Recipe,
    settings: EngineSettings,
    slo_ms: float,
    step: Step,
) -> tuple[list[Candidate], Candidate, list[ProfilePoint]]:
    """Every accepted candidate and PyTorch eager screened together, in short interleaved blocks on
    batches drawn alike from the profiling rows; then the FP32 reference and the candidates that
    could be served timed again, together, for the recipe's full time per batch size, and the
    served one chosen among them. Returns the candidates, the chosen one and the eager profile.

    Screening first, as Triton's model analyzer searches quickly before it measures in detail:
    the full time buys the served variant's p99, which its batching is chosen from, and the
    ratio to FP32 that selection decides on; a variant far behind needs neither. The default
    text recipe spent 2 of its 4 minutes profiling nine runners in full, three of which could win."""
    seconds = recipe.profiling.seconds_per_point
    runtimes = {
        c.variant: onnx_runtime(c.path, spec_of(data.spec, c), settings, c.engine) for c in candidates if c.accepted
    }

    def timed(names: list[str], share: float, blocks: int, eager: Run | None = None) -> dict[str, list[ProfilePoint]]:
        runners = {name: runtime_runner(runtimes[name], sampler(data.profiling.rows)) for name in names}
        if eager is not None:
            runners[EAGER] = eager
        return profile(
            runners, recipe.profiling.max_batch_size, slo_ms=slo_ms, seconds_per_point=seconds * share, blocks=blocks
        )

    step("profiling (screening, interleaved): " + ", ".join(runtimes) + ", PyTorch eager")
    screened = timed(list(runtimes), SCREEN_SHARE, SCREEN_BLOCKS, _eager_runner(task, graph, data))
    candidates = [
        c.model_copy(update={"profile": screened[c.variant], "profile_seconds": seconds * SCREEN_SHARE})
        if c.variant in screened
        else c
        for c in candidates
    ]
    candidates = [_fp16_on_cpu_only(c, candidates[0], slo_ms) for c in candidates]
    finalists = contenders(candidates, slo_ms, recipe.serving.variant)
    step("profiling (in full, interleaved): " + ", ".join(c.variant for c in finalists))
    full = timed([c.variant for c in finalists], 1.0, FULL_BLOCKS)
    candidates = [
        c.model_copy(update={"profile": full[c.variant], "profile_seconds": seconds}) if c.variant in full else c
        for c in candidates
    ]
    finalists = [c for c in candidates if c.variant in full]
    chosen = select(finalists, slo_ms, recipe.serving.variant)
    step(f"working memory of {chosen.variant} per batch size")
    sizes = [p.batch_size for p in chosen.profile]
    spec = spec_of(data.spec, chosen)
    memory = working_memory(chosen.path, spec, settings, chosen.engine, data.profiling.rows, sizes)
    chosen = chosen.model_copy(
        update={"profile": [p.model_copy(update={"memory_mib": memory[p.batch_size]}) for p in chosen.profile]}
    )
    candidates = [chosen if c.variant == chosen.variant else c for c in candidates]
    return candidates, chosen, screened[EAGER]


def contenders(candidates: list[Candidate], slo_ms: float, preferred: str | None) -> list[Candidate]:
    """The FP32 reference, then what screening could not rule out of serving: the recipe's
    `serving.variant`, and every accepted variant within `CONTENDER_SHARE` of the best screened
    throughput (screening times a few calls per batch size: the share leaves room for their noise)."""
    best = max(servable_throughput(c, slo_ms) for c in candidates if c.accepted)
    return [candidates[0]] + [
        c
        for c in candidates[1:]
        if c.accepted and (c.variant == preferred or servable_throughput(c, slo_ms) >= CONTENDER_SHARE * best)
    ]


def spec_of(spec: ModelSpec, candidate: Candidate) -> ModelSpec:
    """What a candidate promises its server: the task's spec, and a cascade's threshold and teacher."""
    return spec.model_copy(update={"cascade": candidate.cascade})


def register_candidate(
    recipe: Recipe, candidate: Candidate, files: dict[str, Path], metadata: dict, selected: bool
) -> bentoml.Model:
    if candidate.cascade is not None:
        files = {**files, TEACHER_FILE: candidate.path.parent / candidate.cascade.teacher_file}
    return register(
        recipe.name,
        {ONNX_FILE: candidate.path, **files},
        labels={
            "task": recipe.task,
            "variant": candidate.variant,
            "precision": candidate.precision,
            ENGINE_LABEL: candidate.engine,
            "recipe": recipe.name,
        },
        metadata=_clean(
            {
                **metadata,
                "variant_config": candidate.config,
                "opset": onnx_opset(candidate.path),
                "evaluation": {
                    "metrics": candidate.metrics,
                    "drops": candidate.drops,
                    "slices": {name: figures.model_dump() for name, figures in candidate.slices.items()},
                },
                "profile": [p.model_dump() for p in candidate.profile],
                "selected": selected,
            }
        ),
    )


def onnx_opset(path: Path) -> int:
    """The default-domain opset a file really uses (the dynamo exporter raises it to 18)."""
    imports = onnx.load(str(path), load_external_data=False).opset_import
    return max(o.version for o in imports if o.domain in ("", "ai.onnx"))


def _clean(value):
    """BentoML metadata takes basic types only: drop None, keep everything else."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def reuse(name: str, content_hash: str) -> BuildResult | None:
    """The newest intact build of this recipe content profiled on this machine: a store used on
    two machines keeps a build for each, and neither rebuilds when the store returns to it."""
    builds = [(m, profiled_elsewhere(m.info.metadata)) for m in find_selected(name, content_hash)]
    model = next((m for m, moved in builds if moved == []), None)
    if model is None:
        if builds:
            moved = builds[0][1]
            log.warning(
                "%s: its stored build was profiled on %s: building it again on this machine",
                name,
                f"another machine ({'; '.join(moved)})" if moved else "a machine it did not record",
            )
        return None
    metadata = model.info.metadata
    return BuildResult(
        model=model,
        batching=Batching.model_validate(metadata["batching"]),
        candidates=[Candidate.model_validate(c) for c in metadata["candidates"]],
        eager=[ProfilePoint.model_validate(p) for p in metadata["eager_profile"]],
        reused=True,
        steps=[StepTime(**step) for step in metadata.get(BUILD_STEPS, [])],
        load=OtherLoad.model_validate(metadata[PROFILE_LOAD]) if PROFILE_LOAD in metadata else None,
        judged_on=metadata.get(JUDGED_ON, ""),
    )
