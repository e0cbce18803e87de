"""The naive baseline: the shape of seed 000's example, without its batching worker.

Plain FastAPI, PyTorch eager, one request per inference:
- `POST /predict {"data": [3·224·224 floats]}`: the client has already decoded, resized and
  normalized the image and sends the tensor as a JSON float list; the answer is every class
  probability as a JSON float list.
- `POST /embed {"texts": [...]}`: transformers' tokenizer, the eager model, mean pooling.

Same weights as the optiserve models (the recipe's sources). Handlers are plain `def`, so
FastAPI runs them in its thread pool and PyTorch uses its default threads: what a first
server usually looks like.

    python -m bench.naive_server --port 8001 [--image-recipe ...] [--text-recipe ...]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from pipeline.recipe import load_recipe
from pipeline.sources import load_source

REPO = Path(__file__).resolve().parent.parent


class PixelsRequest(BaseModel):
    data: list[float]


class TextsRequest(BaseModel):
    texts: list[str]


def create_app(image_recipe: Path | None, text_recipe: Path | None) -> FastAPI:
    app = FastAPI(title="naive baseline")

    if image_recipe is not None:
        loaded = load_recipe(image_recipe)
        classifier = load_source(loaded).module.eval()
        size = loaded.recipe.image.size

        @app.post("/predict")
        def predict(request: PixelsRequest) -> dict:
            if len(request.data) != 3 * size * size:
                raise HTTPException(422, f"expected {3 * size * size} floats, got {len(request.data)}")
            pixels = torch.tensor(request.data, dtype=torch.float32).reshape(1, 3, size, size)
            with torch.inference_mode():
                probabilities = classifier(pixels).softmax(dim=1)[0]
            return {"probs": probabilities.tolist()}

    if text_recipe is not None:
        from transformers import AutoTokenizer

        loaded = load_recipe(text_recipe)
        source = load_source(loaded)
        encoder = source.module.eval()
        tokenizer = AutoTokenizer.from_pretrained(str(source.model_dir), local_files_only=True)
        max_length = loaded.recipe.text.max_length

        @app.post("/embed")
        def embed(request: TextsRequest) -> dict:
            tokens = tokenizer(request.texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            with torch.inference_mode():
                hidden = encoder(**tokens).last_hidden_state
                mask = tokens["attention_mask"].unsqueeze(-1).float()
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                vectors = torch.nn.functional.normalize(pooled, dim=-1)
            return {"embeddings": vectors.tolist()}

    @app.get("/readyz")
    def ready() -> dict:
        return {"ready": True}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--image-recipe", type=Path, default=REPO / "models" / "image-classifier.yaml")
    parser.add_argument("--text-recipe", type=Path, default=REPO / "models" / "text-embedder.yaml")
    args = parser.parse_args()
    uvicorn.run(create_app(args.image_recipe, args.text_recipe), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
