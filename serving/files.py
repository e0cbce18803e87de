"""Files the service reads while others rewrite them (the manifest, the aliases)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Replace the file in one step: a reader meanwhile sees the old content or the new, never half.
    It keeps the mode of the file it replaces, and a new file gets the mode `open` would give it:
    a temporary file's own (0600) would hide it from a service running as another user (the
    image's `bentoml`, reading an alias file the host's user wrote)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as temporary:
        temporary.write(text)
        temporary.flush()
        os.fchmod(temporary.fileno(), _mode_for(path))
        os.fsync(temporary.fileno())
    os.replace(temporary.name, path)


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without setting it (`os.umask` would, for every thread)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022
