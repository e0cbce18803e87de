"""Files the service reads while others rewrite them (the manifest, the aliases)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Replace the file in one step: a reader meanwhile sees the old content or the new, never half."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as temporary:
        temporary.write(text)
    os.replace(temporary.name, path)
