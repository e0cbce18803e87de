"""Process-level serving knobs read from the environment, with defaults sized for small CPUs."""

from __future__ import annotations

import os


def front_workers() -> int:
    """Front workers decode and tokenize; one async worker with a thread pool fills two cores."""
    return int(os.environ.get("OPTISERVE_FRONT_WORKERS", "1"))
