"""optiserve: a front service (HTTP, decoding, tokenizing) over one batched model service per task.

Which stored model serves which endpoint, and its batching settings, come from the serving
manifest that `make optimize` writes (see serving/manifest.py).
"""

from __future__ import annotations

from pathlib import Path

import bentoml
import numpy as np

from serving.api import app
from serving.classify import ImageClassifier, load_class_names
from serving.embed import TextEmbedder
from serving.engine import EngineSettings
from serving.manifest import load_manifest
from serving.metrics import ModelMetrics, install_queue_probe
from serving.model_calls import MODEL_CONNECTIONS, call_model
from serving.model_runtime import ImageModelRuntime, TextModelRuntime, read_spec
from serving.model_spec import TOKENIZER_FILE
from serving.settings import front_workers
from serving.text import TextTokenizer

manifest = load_manifest()
classify_route, embed_route = manifest.classify, manifest.embed
if classify_route is None and embed_route is None:
    raise RuntimeError("the serving manifest routes no endpoint: nothing to serve")

MODEL_SERVICE = {"workers": 1, "traffic": {"timeout": 120}, "runner_connection": MODEL_CONNECTIONS}

if classify_route is not None:

    @bentoml.service(**MODEL_SERVICE)
    class ImageModel:
        stored = bentoml.models.BentoModel(classify_route.tag)

        def __init__(self) -> None:
            spec = read_spec(self.stored.info.metadata)
            self.runtime = ImageModelRuntime(Path(self.stored.path), spec, EngineSettings.from_environment())
            self.runtime.warm_up(classify_route.max_batch_size)
            self.metrics = ModelMetrics(endpoint="classify", model=str(self.stored.tag))
            install_queue_probe(self.metrics.observe_queue_wait)

        @bentoml.api(
            batchable=True,
            max_batch_size=classify_route.max_batch_size,
            max_latency_ms=classify_route.max_latency_ms,
        )
        def predict(self, images: np.ndarray) -> np.ndarray:
            with self.metrics.batch(rows=len(images)):
                return self.runtime.predict(images)


if embed_route is not None:

    @bentoml.service(**MODEL_SERVICE)
    class TextModel:
        stored = bentoml.models.BentoModel(embed_route.tag)

        def __init__(self) -> None:
            spec = read_spec(self.stored.info.metadata)
            self.runtime = TextModelRuntime(Path(self.stored.path), spec, EngineSettings.from_environment())
            self.runtime.warm_up(embed_route.max_batch_size)
            self.metrics = ModelMetrics(endpoint="embed", model=str(self.stored.tag))
            install_queue_probe(self.metrics.observe_queue_wait)

        @bentoml.api(
            batchable=True,
            max_batch_size=embed_route.max_batch_size,
            max_latency_ms=embed_route.max_latency_ms,
        )
        def predict(self, token_ids: list[list[int]]) -> np.ndarray:
            with self.metrics.batch(rows=len(token_ids)):
                return self.runtime.predict(token_ids)


@bentoml.service(name="optiserve", workers=front_workers(), traffic={"timeout": 120})
@bentoml.asgi_app(app, path="/")
class Optiserve:
    classifier: ImageClassifier | None = None
    classifier_tag = ""
    embedder: TextEmbedder | None = None
    embedder_tag = ""

    if classify_route is not None:
        image_model = bentoml.depends(ImageModel)
        image_stored = bentoml.models.BentoModel(classify_route.tag)
    if embed_route is not None:
        text_model = bentoml.depends(TextModel)
        text_stored = bentoml.models.BentoModel(embed_route.tag)

    def __init__(self) -> None:
        if classify_route is not None:
            spec = read_spec(self.image_stored.info.metadata)
            self.classifier_tag = str(self.image_stored.tag)
            self.classifier = ImageClassifier(
                spec=spec.image,
                class_names=load_class_names(Path(self.image_stored.path)),
                # Remote clients gain their methods only after startup, so resolve them per call.
                predict=lambda images: call_model(self.image_model.to_async.predict, images),
                max_batch_size=classify_route.max_batch_size,
                max_items_per_request=classify_route.max_items_per_request,
            )
        if embed_route is not None:
            spec = read_spec(self.text_stored.info.metadata)
            self.embedder_tag = str(self.text_stored.tag)
            self.embedder = TextEmbedder(
                tokenizer=TextTokenizer(Path(self.text_stored.path) / TOKENIZER_FILE, max_length=spec.text.max_length),
                embed_ids=lambda token_ids: call_model(self.text_model.to_async.predict, token_ids),
                max_batch_size=embed_route.max_batch_size,
                max_items_per_request=embed_route.max_items_per_request,
            )
