"""Runtime code of the optiserve service: no torch, no transformers, no pipeline imports."""

import logging

# `bentoml serve` keeps loggers outside its own at WARNING; the start-up lines (which model runs
# on which engine and CPU, warm-up times) belong in its log.
logging.getLogger(__name__).setLevel(logging.INFO)
