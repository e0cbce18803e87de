"""`python -m pipeline models/*.yaml` builds recipes (pipeline/build_command.py);
`python -m pipeline promote|rollback|aliases …` moves and shows aliases (pipeline/lifecycle.py)."""

from __future__ import annotations

import sys

from pipeline import lifecycle


def main(argv: list[str] | None = None) -> int:
    """An alias command, else a build; the build's imports (torch, 10 s) only for a build."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in lifecycle.COMMANDS:
        return lifecycle.main(argv)
    from pipeline.build_command import main as build

    return build(argv)


if __name__ == "__main__":
    sys.exit(main())
