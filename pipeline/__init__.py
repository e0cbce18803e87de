"""The offline pipeline: recipe → ONNX → checked → BentoML model store → serving manifest."""
