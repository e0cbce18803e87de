"""The engines behind one interface: OpenVINO computes what ONNX Runtime computes on the same
file, is safe to call from several threads, and a model stored with it is served by it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bentoml
import numpy as np
import pytest
from conftest import REPO, own_home, quick, serving

from pipeline.build import BuildResult, build
from pipeline.datasets import photo_split
from pipeline.recipe import load_recipe
from sample_inputs import sample_photos
from serving.engine import EngineSettings, open_engine
from serving.manifest import ServingManifest, read_manifest, write_manifest
from serving.model_calls import on_lowered_thread
from serving.model_runtime import engine_of, read_spec
from serving.model_spec import ONNX_FILE


def fp32_export(built: BuildResult) -> Path:
    return Path(built.model.path) / ONNX_FILE


@pytest.fixture(scope="module")
def photos(built_models: dict[str, BuildResult]) -> np.ndarray:
    spec = read_spec(built_models["image-classifier"].model.info.metadata)
    return np.stack(photo_split(spec.image, "held-out").rows[:64])


def test_openvino_gives_onnx_runtimes_probabilities_on_real_photos(built_models, photos: np.ndarray) -> None:
    path = fp32_export(built_models["image-classifier"])
    engines = [open_engine(name, path, EngineSettings(2)) for name in ("onnxruntime", "openvino")]
    (ort_out,), (ov_out,) = [list(engine.run({engine.input_names[0]: photos}).values()) for engine in engines]
    np.testing.assert_allclose(ov_out, ort_out, atol=1e-4)
    assert (ov_out.argmax(axis=1) == ort_out.argmax(axis=1)).all()


def test_openvino_answers_each_calling_thread_with_its_own_rows(built_models, photos: np.ndarray) -> None:
    engine = open_engine("openvino", fp32_export(built_models["image-classifier"]), EngineSettings(1))
    name = engine.input_names[0]
    alone = [engine.run({name: photos[i : i + 1]})[engine.output_names[0]] for i in range(len(photos))]
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(lambda i: engine.run({name: photos[i : i + 1]})[engine.output_names[0]], range(len(photos)))
        )
    for one, other in zip(alone, together, strict=True):
        np.testing.assert_array_equal(one, other)


def thread_nice_values(process: int | str = "self") -> dict[int, int]:
    """Each live thread of a process and its nice value (/proc: the 19th field of its stat).

    A thread can end between listing the tasks and reading its stat; it is left out.
    """
    values = {}
    for task in Path(f"/proc/{process}/task").iterdir():
        try:
            values[int(task.name)] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return values


def test_a_session_opened_on_a_lowered_thread_runs_its_own_threads_lowered_and_the_caller_is_untouched(
    built_models,
) -> None:
    before = thread_nice_values()
    path = fp32_export(built_models["image-classifier"])
    engine = on_lowered_thread(7, lambda: open_engine("onnxruntime", path, EngineSettings(2)))
    started = {tid: nice for tid, nice in thread_nice_values().items() if tid not in before}

    assert started and set(started.values()) == {before[threading.get_native_id()] + 7}  # ONNX Runtime's pool
    assert thread_nice_values()[threading.get_native_id()] == before[threading.get_native_id()]
    del engine


def test_an_unknown_engine_is_named_with_the_known_ones(built_models) -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'tvm' \(known: onnxruntime, openvino, openvino-bf16\)"):
        open_engine("tvm", fp32_export(built_models["image-classifier"]), EngineSettings(1))


@pytest.mark.slow
def test_a_model_stored_with_openvino_is_served_by_it(manifest_file: Path, tmp_path: Path) -> None:
    build(quick(load_recipe(REPO / "models" / "image-classifier.yaml"), variants=["openvino"]))
    stored = max(
        (m for m in bentoml.models.list("image-classifier") if m.info.labels["variant"] == "openvino"),
        key=lambda m: m.info.creation_time,
    )
    assert engine_of(stored) == "openvino"
    defaults = read_manifest(manifest_file)
    routed = tmp_path / "serving-manifest.json"
    classify = defaults.classify.model_copy(update={"tag": str(stored.tag)})
    write_manifest(ServingManifest(classify=classify, embed=defaults.embed), routed)
    photo = {"image": ("chelsea.jpg", sample_photos()["chelsea"], "image/jpeg")}
    home = own_home(tmp_path / "home")
    with serving(routed, tmp_path / "bentoml.log", BENTOML_HOME=home) as server, server.client() as client:
        body = client.post("/classify", files=photo).json()
    assert body["model"] == str(stored.tag)
    assert body["predictions"][0]["label"] in {"tabby", "tiger cat", "Egyptian cat"}
    assert f"{stored.tag} runs on openvino" in (tmp_path / "bentoml.log").read_text()
