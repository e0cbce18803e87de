"""The benchmark scripts' own logic, on the test store and a tiny real server (their figures
belong in BENCHMARKS.md)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tiny_http import directives

from bench.limit import BATCH_SIZES, text_limit
from bench.serving import first_of_type, sentence_near, stall_check, verdicts, wrk_check
from bench.swap import DRAIN_S, SwapLines, summarize
from bench.variants import main
from bench.wrk import run_wrk, wrk_installed
from loadtest.stats import Outcome, Recorder
from loadtest.sweep import SweepSettings, run_sweep
from sample_inputs import sample_texts
from serving.lifecycle import SWAPPED

needs_wrk = pytest.mark.skipif(not wrk_installed(), reason="wrk is not installed (apt-get install wrk)")


def test_variants_bench_times_a_run_against_its_fp32(built_models, tmp_path) -> None:
    tag = str(built_models["text-embedder"].model.tag)

    assert main([tag, "--batch", "2", "--sequence-length", "16", "--seconds", "0.2", "--out", str(tmp_path)]) == 0

    (written,) = tmp_path.glob("variants-*.json")
    run = json.loads(written.read_text())
    rows = run["rows"]
    assert rows[0]["variant"] == "fp32"
    # Whose figures these are: the machine, and how much of it other work took meanwhile.
    assert run["machine"]["isa"] == rows[0]["isa"] and run["other_work"]["busy_cores"] >= 0
    assert {row["model"].split(":")[0] for row in rows} == {"text-embedder"}
    fp32 = rows[0]
    assert fp32["speedup_vs_fp32"] == 1.0 and fp32["rows_per_s"] > 0 and fp32["batch"] == 2


def test_limit_tries_every_batch_size_whatever_the_served_cap(built_models) -> None:
    built = built_models["text-embedder"]
    assert built.batching.max_batch_size < max(BATCH_SIZES), "the test store profiles small batches only"

    limit = text_limit(built.model, sample_texts(64), seconds=0.1, slo_ms=1e6)

    assert sorted(limit.rows_per_s) == list(BATCH_SIZES)
    assert limit.throughput == max(limit.rows_per_s.values()) == limit.rows_per_s[limit.best_batch]
    assert 0 < limit.batch1_p50_ms <= limit.batch1_p99_ms


def test_the_limit_of_one_input_alone_times_batch_1_only(built_models) -> None:
    limit = text_limit(
        built_models["text-embedder"].model, ["one short sentence"], seconds=0.1, slo_ms=1e6, batch_sizes=(1,)
    )

    assert list(limit.rows_per_s) == [1] and limit.best_batch == 1
    assert 0 < limit.batch1_p50_ms <= limit.batch1_p99_ms


@needs_wrk
def test_wrk_sends_every_body_in_turn_and_counts_failed_statuses(tiny_server) -> None:
    payloads = [directives(n=1), directives(n=2, status=503), directives(n=3, status=404)]

    result = run_wrk(f"{tiny_server.url}/wrk", payloads, connections=2, seconds=1)

    sent = Counter(body for _, _, body in tiny_server.requests)
    assert set(sent) == {p.body for p in payloads} and max(sent.values()) - min(sent.values()) <= 2
    assert result.requests >= len(tiny_server.requests) - 2  # wrk does not count those cut off at the end
    assert abs(result.errors["status"] - 2 * result.requests / 3) <= 2
    assert result.throughput == pytest.approx((result.requests - result.errors["status"]) / result.seconds)


@needs_wrk
def test_loadtest_reads_a_latency_bound_server_like_wrk(tiny_server) -> None:
    """Two connections on a server that answers in 50 ms: both generators must see about 40/s."""
    url, payloads = f"{tiny_server.url}/slow", [directives(sleep=0.05)]
    settings = SweepSettings(url=url, levels=(2,), warmup_s=0.3, window_s=1.0, stable_windows=2, metrics_url="")
    knee = run_sweep(settings, payloads, {"kind": "test"}).knee

    check = wrk_check(url, payloads, knee.level, knee.throughput, seconds=2)

    assert check["wrk_throughput"] == pytest.approx(40, rel=0.1)
    assert check["met"], check
    assert check["concurrency"] == 2 and all(run["connections"] == 2 for run in check["wrk_runs"])
    assert len(check["loadtest_runs"]) == len(check["wrk_runs"]) == 3  # alternated, three rounds each


def test_the_stall_check_repeats_one_request_at_concurrency_1(tiny_server) -> None:
    payloads = [directives(sleep=0.02), directives(sleep=0.2)]

    check = stall_check(f"{tiny_server.url}/slow", payloads[0], seconds=1.0)

    assert check["input"] == payloads[0].name and 10 <= check["requests"] <= 50
    assert 20 <= check["p50_ms"] <= check["p99_ms"] < 200, "the 200 ms body was never sent"


def test_the_stall_check_sends_a_jpeg_photo_or_a_sentence_of_about_16_tokens() -> None:
    from loadtest.inputs import Payload, text_payloads

    photos = [Payload("a.png", b"png", "image/png"), Payload("b.jpg", b"jpg", "image/jpeg")]
    assert first_of_type(photos, "image/jpeg").name == "b.jpg"
    texts = text_payloads(["two words", "a sentence of exactly twelve words that is about sixteen tokens long", "x"])
    chosen = sentence_near(texts, 12)
    assert json.loads(chosen.body)["texts"] == ["a sentence of exactly twelve words that is about sixteen tokens long"]


def test_a_mixed_inputs_c1_spread_is_judged_against_the_engines_own_and_stalls_on_one_input() -> None:
    def server(c1: tuple[float, float], one: tuple[float, float]) -> dict:
        return {
            "knee_throughput": 100.0,
            "knee_p50_ms": 10.0,
            "knee_p99_ms": 20.0,
            "c1_p50_ms": c1[0],
            "c1_p99_ms": c1[1],
            "errors_below_knee": 0,
            "one_input_c1": {"input": "b.jpg", "p50_ms": one[0], "p99_ms": one[1]},
        }

    limit = {"throughput": 100.0, "batch1_p50_ms": 3.0, "batch1_p99_ms": 12.0}  # the engine's own spread: 4 ×
    spread_of_the_mix = verdicts(
        "text", {"limit": limit, "optiserve": server((4, 14), (4, 6)), "naive": {"knee_throughput": 10.0}}, None
    )
    assert spread_of_the_mix["c1_p99_vs_p50_mix"]["met"] and spread_of_the_mix["c1_p99_vs_p50"]["met"]
    stalling = verdicts(
        "text", {"limit": limit, "optiserve": server((4, 20), (4, 9)), "naive": {"knee_throughput": 10.0}}, None
    )
    assert not stalling["c1_p99_vs_p50_mix"]["met"] and not stalling["c1_p99_vs_p50"]["met"]


def test_the_c1_excess_is_judged_on_one_input_against_the_limit_on_that_input_alone() -> None:
    """The mix's two medians can land on either side of a gap between its inputs: recorded, not judged."""
    server = {
        "knee_throughput": 100.0,
        "knee_p50_ms": 10.0,
        "knee_p99_ms": 20.0,
        "c1_p50_ms": 9.5,  # the mix's median fell on a slow photo ...
        "c1_p99_ms": 16.0,
        "errors_below_knee": 0,
        "one_input_c1": {"input": "b.jpg", "p50_ms": 7.0, "p99_ms": 8.0},
    }

    def excess(alone: dict) -> dict:
        limit = {"throughput": 100.0, "batch1_p50_ms": 6.0, "batch1_p99_ms": 15.0, "one_input": alone}
        figures = {"limit": limit, "optiserve": server, "naive": {"knee_throughput": 10.0}}
        return verdicts("image", figures, None).get("c1_p50_vs_limit_batch1")

    judged = excess({"input": "b.jpg", "batch1_p50_ms": 5.8, "batch1_p99_ms": 6.5})
    assert judged["met"] and judged["excess_ms"] == pytest.approx(1.2) and judged["input"] == "b.jpg"
    assert judged["mix_excess_ms"] == pytest.approx(3.5)  # ... the limit's on a fast one
    assert not excess({"input": "b.jpg", "batch1_p50_ms": 5.0, "batch1_p99_ms": 6.0})["met"]
    assert excess({"input": "a.png", "batch1_p50_ms": 5.8, "batch1_p99_ms": 6.5}) is None, "another input: no verdict"

    server["one_input_c1"] |= {"wrk_p50_ms": 6.5}  # wrk's reading, where installed, is the one judged
    read_by_wrk = excess({"input": "b.jpg", "batch1_p50_ms": 5.8, "batch1_p99_ms": 6.5})
    assert read_by_wrk["read_with"] == "wrk" and read_by_wrk["excess_ms"] == pytest.approx(0.7)
    assert read_by_wrk["loadtest_excess_ms"] == pytest.approx(1.2)


def test_the_swap_bench_counts_logged_swaps_and_holds_each_swap_to_the_phase_before_it(tmp_path) -> None:
    log = tmp_path / "bentoml.log"
    log.write_text(f"started\n/embed: a → b, {SWAPPED}; a released\n/embed: b → a, loaded and warm")
    swaps = SwapLines(log, SWAPPED)
    assert swaps.count() == 1, "a line still being written is not counted"
    with log.open("a") as handle:
        handle.write("ed up; b released\n")
    assert swaps.count() == 2

    recorder = Recorder()
    for second in range(40):  # 10 ms while steady, 30 ms while swapping, one failure after the swap
        swapping = 10 <= second < 12 + DRAIN_S
        recorder.add(Outcome(finished=float(second), latency=0.03 if swapping else 0.01, status="200"))
    recorder.add(Outcome(finished=20.5, latency=0.01, status="503"))
    marks = {"start": 0.0, "swap0": 10.0, "swap0_done": 12.0, "end": 40.0}

    results = summarize({"marks": marks, "outcomes": recorder}, swaps=1)

    assert results["phases"]["swap 1"]["p99_vs_before"] == pytest.approx(3.0)
    assert results["phases"]["after swap 1"]["errors"] == {"503": 1}
    assert results["target"]["failed"] == 1 and not results["target"]["met"]
