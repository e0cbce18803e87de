"""The benchmark scripts' own logic, on the test store (their figures belong in BENCHMARKS.md)."""

from __future__ import annotations

import json

from bench.variants import main


def test_variants_bench_times_a_run_against_its_fp32(built_models, tmp_path) -> None:
    tag = str(built_models["text-embedder"].model.tag)

    assert main([tag, "--batch", "2", "--sequence-length", "16", "--seconds", "0.2", "--out", str(tmp_path)]) == 0

    (written,) = tmp_path.glob("variants-*.json")
    rows = json.loads(written.read_text())["rows"]
    assert rows[0]["variant"] == "fp32"
    assert {row["model"].split(":")[0] for row in rows} == {"text-embedder"}
    fp32 = rows[0]
    assert fp32["speedup_vs_fp32"] == 1.0 and fp32["rows_per_s"] > 0 and fp32["batch"] == 2
