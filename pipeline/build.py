"""One recipe end to end: source → ONNX → export check → model store, reusing unchanged work."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bentoml
import onnx
import torch

from pipeline.export import export_onnx, serving_graph
from pipeline.export_check import check_export, image_batches, text_batches
from pipeline.recipe import LoadedRecipe
from pipeline.registry import RECIPE_HASH, find_registered, register
from pipeline.sources import load_source
from serving.manifest import Route
from serving.model_spec import CLASS_NAMES_FILE, ONNX_FILE, SPEC_KEY, TOKENIZER_FILE, ImageInput, ModelSpec, TextInput

# Bump when export or registration changes what an unchanged recipe produces.
EXPORT_REVISION = "1"
Step = Callable[[str], None]


@dataclass(frozen=True)
class BuildResult:
    model: bentoml.Model
    reused: bool

    def route(self, loaded: LoadedRecipe) -> Route:
        serving = loaded.recipe.serving
        return Route(
            tag=str(self.model.tag),
            recipe=loaded.recipe.name,
            max_batch_size=serving.max_batch_size,
            max_latency_ms=serving.max_latency_ms,
            max_items_per_request=serving.max_items_per_request,
        )


def recipe_hash(loaded: LoadedRecipe) -> str:
    return loaded.content_hash(extra=f"{EXPORT_REVISION}|torch={torch.__version__!s}|onnx={onnx.__version__}")


def build(loaded: LoadedRecipe, *, step: Step = lambda _: None, force: bool = False) -> BuildResult:
    content_hash = recipe_hash(loaded)
    if not force and (existing := find_registered(loaded.name, content_hash, "fp32")) is not None:
        return BuildResult(existing, reused=True)
    recipe = loaded.recipe
    step("loading source model")
    source = load_source(loaded)
    graph = serving_graph(recipe, source)
    with tempfile.TemporaryDirectory(prefix="optiserve-") as scratch:
        workdir = Path(scratch)
        step("exporting to ONNX")
        onnx_path = export_onnx(graph, workdir / ONNX_FILE, opset=recipe.export.opset)
        files = {ONNX_FILE: onnx_path}
        if recipe.task == "image-classification":
            (workdir / CLASS_NAMES_FILE).write_text(json.dumps(source.class_names))
            files[CLASS_NAMES_FILE] = workdir / CLASS_NAMES_FILE
            spec = ModelSpec(
                task=recipe.task,
                image=ImageInput(size=recipe.image.size, resize=recipe.image.resize),
                input_names=graph.input_names,
                output_names=graph.output_names,
            )
            batches = image_batches(recipe)
        else:
            files[TOKENIZER_FILE] = source.model_dir / TOKENIZER_FILE
            spec = ModelSpec(
                task=recipe.task,
                text=TextInput(
                    max_length=recipe.text.max_length,
                    pad_token_id=source.module.config.pad_token_id or 0,
                    dimensions=source.module.config.hidden_size,
                ),
                input_names=graph.input_names,
                output_names=graph.output_names,
            )
            batches = text_batches(files[TOKENIZER_FILE], recipe.text.max_length)
        step("checking ONNX against PyTorch")
        check = check_export(recipe, graph, onnx_path, batches)
        step("registering in the model store")
        model = register(
            recipe.name,
            files,
            labels={
                "task": recipe.task,
                "variant": "fp32",
                "precision": "fp32",
                "runtime": "onnxruntime",
                "recipe": recipe.name,
            },
            metadata={
                RECIPE_HASH: content_hash,
                SPEC_KEY: spec.model_dump(mode="json", exclude_none=True),
                "source": recipe.source.model_dump(mode="json"),
                "export_check": check.as_metadata(),
                "opset": recipe.export.opset,
                "versions": {"torch": str(torch.__version__), "onnx": onnx.__version__},
            },
        )
    return BuildResult(model, reused=False)
