"""schemathesis against the live service's own OpenAPI document: no 5xx, and every answer (status,
content type, headers, body) is one the document declares. `make fuzz` runs it at 200 examples
per operation (about 3 000 requests); the suite at FUZZ_EXAMPLES, default 10."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.door import DEADLINE_HEADER

pytestmark = pytest.mark.slow

CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
    )
)
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


def test_generated_requests_get_documented_answers_and_no_5xx(server) -> None:
    """Every request carries a deadline of a minute: a generated one of 1 ms is refused with a
    503 by design (tests/test_door.py, tests/test_batching.py), which the check counts as a fault."""
    examples = os.environ.get("FUZZ_EXAMPLES", "10")
    run = subprocess.run(
        [
            *(str(SCHEMATHESIS), "run", f"{server.url}/docs.json", "--checks", CHECKS),
            *("--header", f"{DEADLINE_HEADER}: 60000"),
            *("--max-examples", examples, "--workers", "1", "--seed", os.environ.get("FUZZ_SEED", "1")),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = run.stdout[run.stdout.find("SUMMARY") :]
    print(summary)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "passed" in summary
