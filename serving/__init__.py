"""Runtime code of the optiserve service: no torch, no transformers, no pipeline imports."""
