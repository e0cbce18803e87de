"""The offline pipeline: recipe → ONNX → checked → BentoML model store → serving manifest."""

import os

# Models come from packages or local paths, never from a hub: many users' machines cannot reach one.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
