"""`python tests/kill_at.py EVENT TEXT N -- ARGS…`: run `python -m pipeline ARGS…` and SIGKILL it the
moment it makes its N-th audited operation EVENT (sys.audit: "open", "shutil.copyfile",
"os.rename", "os.replace") on a path containing TEXT. A fault injector: the process dies
at that exact point, as under the OOM killer or a node loss, with nothing cleaned up."""

from __future__ import annotations

import os
import runpy
import signal
import sys

event, text, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = 0


def kill_at(name: str, args: tuple) -> None:
    global seen
    if name == event and any(text in str(arg) for arg in args[:2]):
        seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)


sys.argv = ["pipeline", *sys.argv[sys.argv.index("--") + 1 :]]
sys.addaudithook(kill_at)
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
