"""The run's GEMM peak (`bench_mil.GemmPeak`): several readings, shares against the highest, the
spread between them. Its bookkeeping only: the readings are injected, nothing is timed."""

from __future__ import annotations

import pytest

from benchmarks.bench_mil import GemmPeak


def _peak(readings: list[float]) -> GemmPeak:
    it = iter(readings)
    return GemmPeak(lambda: next(it))


def test_shares_are_of_the_highest_reading_whenever_it_came() -> None:
    peak = _peak([140.0, 170.0, 160.0])
    assert peak.sample("start") == 140.0
    assert peak.share(70.0) == pytest.approx(0.5)  # against the only reading so far
    peak.sample("after n=2048")
    peak.sample("end")
    assert peak.best == 170.0
    assert peak.share(136.0) == pytest.approx(0.8)
    assert peak.spread == pytest.approx(30.0 / 170.0)
    rec = peak.record()
    assert rec["max_gflops"] == 170.0 and rec["min_gflops"] == 140.0
    assert [s["when"] for s in rec["samples"]] == ["start", "after n=2048", "end"]
    assert "170.0" in peak.summary() and "3 readings" in peak.summary() and "18%" in peak.summary()


def test_one_reading_has_no_spread() -> None:
    peak = _peak([150.0])
    peak.sample("start")
    assert peak.spread == 0.0 and peak.best == 150.0


def test_no_reading_and_bad_readings_are_refused() -> None:
    with pytest.raises(ValueError, match="no GEMM peak"):
        _ = _peak([]).best
    peak = _peak([0.0, float("nan")])
    for _ in range(2):
        with pytest.raises(ValueError, match="positive"):
            peak.sample("start")
    assert peak.samples == []
