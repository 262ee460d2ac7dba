"""The held-out trace generator (tests/support/heldout.py) and its score
(benchmarks/score_synthetic.py): deterministic, labelled, within the ranges it promises."""

from __future__ import annotations

import sys

import pytest
from support.heldout import BENIGN, LEAKS, scenario
from support.paths import ROOT

from otel_gpu.detect.model import Point

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", LEAKS + BENIGN)
def test_every_kind_is_deterministic_and_labelled(kind: str) -> None:
    a, b = scenario(kind, 11), scenario(kind, 11)
    assert [p.used_bytes for p in a.points] == [p.used_bytes for p in b.points]
    assert a.points != scenario(kind, 12).points
    assert all(isinstance(p, Point) and p.used_bytes is not None for p in a.points)
    interval = a.points[1].time - a.points[0].time
    assert 1.0 <= interval <= 60.0
    if kind in LEAKS:
        assert a.label == "leak" and a.onset_s is not None and a.rate_bytes_per_s is not None
        assert 30e6 / 3600 <= a.rate_bytes_per_s <= 3000e6 / 3600
        assert a.points[-1].time >= a.onset_s + 6 * 3600  # time enough to be found
        grown = a.points[-1].used_bytes - min(p.used_bytes for p in a.points if p.time > 900)
        assert grown > 0
    else:
        assert a.label == "benign" and a.onset_s is None


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        scenario("nope", 0)


def test_the_score_counts_false_alarms_and_delays() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from score_synthetic import score

    rows = score(2, 1_000_000, kinds=("leak", "cache"))
    assert [r["kind"] for r in rows] == ["leak", "leak", "cache", "cache"]
    for r in rows:
        if r["kind"] == "leak":
            assert r["delay_s"] is None or r["delay_s"] >= 0  # type: ignore[operator]
        else:
            assert r["onset_s"] is None and r["delay_s"] is None
