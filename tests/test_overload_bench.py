"""The overload benchmark's figures: goodput over the flood, refusal latency, recovery time, memory;
and one short run of it against a real `bentoml serve`."""

from __future__ import annotations

import json

import pytest
from conftest import own_home

from bench import overload
from bench.overload import (
    BUCKET_S,
    lone_client_verdict,
    recovered_after,
    rss_verdict,
    summarize_flood,
    summarize_lone_client,
    verdicts,
)
from loadtest.stats import Outcome

STEADY = [(0.0, 500.0), (30.0, 560.0), (66.0, 510.0)]


def test_recovery_starts_at_the_first_bucket_from_which_the_pooled_p99_stays_within_bound() -> None:
    slow, quick = [0.9] * 10, [0.005] * 99
    assert recovered_after([slow, slow, quick, quick], bound_ms=10.0) == 2 * BUCKET_S
    assert recovered_after([quick, [*quick, 0.02], quick], bound_ms=10.0) == 0.0, "one slow request in 300"
    assert recovered_after([quick, slow], bound_ms=10.0) is None


def test_flood_figures_count_goodput_per_second_and_refusals_apart_from_accepted() -> None:
    started, stopped = 100.0, 110.0
    flooded = [Outcome(finished=100.0 + i / 10, latency=0.2, status="200", server_ms=150.0) for i in range(50)]
    flooded += [Outcome(finished=105.0, latency=0.002, status="503", refusal="overloaded", server_ms=0.1)] * 97
    flooded += [Outcome(finished=105.0, latency=0.002, status="429", refusal="queue_full", server_ms=0.3)]
    flooded += [Outcome(finished=105.0, latency=0.25, status="503", refusal="expired", server_ms=220.0)] * 2
    flooded += [Outcome(finished=105.0, latency=0.9, status="429", held=True)]
    probed = [Outcome(finished=stopped + 0.1, latency=0.5, status="200")]
    probed += [Outcome(finished=stopped + 0.6 + i / 100, latency=0.004, status="200") for i in range(40)]

    flood = summarize_flood(
        flooded, probed, started, stopped, concurrency=32, bound_ms=6.0, deadline_ms=200.0, rss=STEADY
    )

    assert flood.goodput == 5.0 and flood.on_time == 5.0
    assert flood.statuses == {"200": 50, "429": 2, "503": 99}
    assert flood.accepted_p99_ms == 200.0 and flood.refused_p99_ms == 250.0
    assert flood.accepted_server_p99_ms == 150.0, "the server's own time for the answers"
    assert flood.refused_at_once_p99_ms == 250.0, "the refusal held for an early retry apart"
    assert (flood.refused_on_admission, flood.refused_on_admission_p99_ms) == (98, 2.0)
    assert flood.refused_on_admission_server_p99_ms == 0.3, "the server's own time for them"
    assert (flood.expired, flood.expired_p99_ms) == (2, 250.0), "admitted, then refused in the queue: apart"
    assert flood.recovery_p99_ms[0] == 500.0 and flood.recovered_after_s == BUCKET_S


def test_refusals_sent_in_the_floods_onset_are_also_read_apart() -> None:
    """The clients' first requests all go out at once and queue on the event loop together."""
    onset = [Outcome(finished=0.1, latency=0.09, status="503", refusal="overloaded", server_ms=0.1)] * 10
    later = [Outcome(finished=2.0 + i / 100, latency=0.003, status="503", refusal="overloaded") for i in range(90)]

    flood = summarize_flood(onset + later, [], 0.0, 5.0, concurrency=8, bound_ms=10.0, deadline_ms=200.0, rss=STEADY)

    assert flood.refused_on_admission_p99_ms == 90.0
    assert flood.refused_on_admission_after_onset_p99_ms == 3.0


def test_the_client_beside_the_flood_is_read_on_its_refusals_on_admission_alone() -> None:
    refusal = dict(status="503", refusal="overloaded", server_ms=0.2)
    sent = [Outcome(finished=1.0, latency=i / 1000, **refusal) for i in range(1, 10)]
    sent += [Outcome(finished=1.0, latency=0.012, status="200")]
    sent += [Outcome(finished=1.0, latency=0.9, status="503", refusal="expired", server_ms=900.0)]

    lone = summarize_lone_client(sent)

    assert (lone["sent"], lone["refused_on_admission"]) == (11, 9)
    assert lone["statuses"] == {"200": 1, "503": 10}
    assert lone["refused_ms"]["p99"] == 9.0 and lone["refused_in_server_ms"]["p99"] == 0.2
    assert not lone_client_verdict(lone)["met"], "9 ms is over the issue's 5"
    assert lone_client_verdict(summarize_lone_client(sent[:5]))["met"], "5 ms at most"
    assert not lone_client_verdict(summarize_lone_client(sent[9:]))["met"], "nothing refused is no reading"


def test_answers_later_than_the_deadline_count_as_goodput_but_not_as_on_time() -> None:
    flooded = [Outcome(finished=0.5, latency=0.15, status="200") for _ in range(30)]
    flooded += [Outcome(finished=0.9, latency=0.25, status="200") for _ in range(10)]

    flood = summarize_flood(flooded, [], 0.0, 1.0, concurrency=8, bound_ms=10.0, deadline_ms=200.0, rss=STEADY)

    assert flood.goodput == 40.0 and flood.on_time == 30.0
    met = verdicts(knee_throughput=40.0, unloaded_p99_ms=5.0, slo_ms=200.0, flood=flood)
    assert met["goodput_vs_knee"]["met"] and not met["on_time_vs_knee"]["met"], "30 on time of a knee of 40"


def test_targets_follow_the_issue() -> None:
    flooded = [Outcome(finished=1.0, latency=0.1, status="200") for _ in range(95)]
    flood = summarize_flood(flooded, [], 0.0, 1.0, concurrency=8, bound_ms=10.0, deadline_ms=1000.0, rss=STEADY)

    met = verdicts(knee_throughput=100.0, unloaded_p99_ms=5.0, slo_ms=1000.0, flood=flood)

    assert met["goodput_vs_knee"]["met"] and met["on_time_vs_knee"]["met"]
    assert met["refusals_p99_ms"]["met"] and met["accepted_p99_vs_slo_ms"]["met"]
    assert not verdicts(knee_throughput=120.0, unloaded_p99_ms=5.0, slo_ms=1000.0, flood=flood)["goodput_vs_knee"][
        "met"
    ]


def test_a_flood_may_raise_memory_while_it_lasts_but_not_leave_it_raised() -> None:
    assert rss_verdict(STEADY)["met"]
    assert not rss_verdict([(0.0, 500.0), (30.0, 600.0), (66.0, 600.0)])["met"], "left 20 % behind"
    assert not rss_verdict([(0.0, 500.0), (30.0, 900.0), (66.0, 500.0)])["met"], "unbounded while it lasted"


def test_any_status_but_200_429_and_503_misses_the_target() -> None:
    flooded = [Outcome(finished=1.0, latency=0.1, status=status) for status in ("200", "503", "500")]
    flood = summarize_flood(flooded, [], 0.0, 1.0, concurrency=8, bound_ms=10.0, deadline_ms=1000.0, rss=STEADY)

    assert not verdicts(knee_throughput=1.0, unloaded_p99_ms=5.0, slo_ms=1000.0, flood=flood)["only_200_429_503"]["met"]


@pytest.mark.slow
def test_a_short_flood_of_the_test_store_runs_every_phase_and_records_it(manifest_file, tmp_path, monkeypatch) -> None:
    """`bench.overload --quick` end to end: a sweep, the knee again, a flood of clients asking a
    deadline the queue cannot keep for most of them, the recovery, the JSON and the plot."""
    monkeypatch.setenv("BENTOML_HOME", own_home(tmp_path / "bentoml"))  # the server's, beside the suite's
    argv = ["--manifest", str(manifest_file), "--models", "text", "--quick", "--out", str(tmp_path)]
    assert overload.main([*argv, "--flood-concurrency", "32", "--deadline-ms", "50"]) == 0

    (report,) = tmp_path.glob("overload-*.json")
    text = json.loads(report.read_text())["models"]["text"]
    assert text["knee"]["throughput"] > 0 and text["knee"]["throughput_again"] > 0
    flood = text["flood"]
    assert flood["concurrency"] == 32 and flood["goodput"] > 0
    assert set(flood["statuses"]) <= {"200", "429", "503"} and text["targets"]["only_200_429_503"]["met"]
    assert flood["refused_on_admission"] > 0 and flood["refused_on_admission_server_p99_ms"] is not None
    assert flood["recovery_p99_ms"] and flood["rss_mib"]
    lone = flood["lone_client"]
    assert lone["sent"] > 10 and lone["refused_on_admission"] > 0, "one more client, refused beside the flood"
    assert text["targets"]["lone_client_refusals_p99_ms"]["in_server_p99_ms"] is not None
    assert report.with_suffix(".png").exists()
