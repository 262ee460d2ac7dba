"""The sampling helper's hang monitor sleeps until a sweep could first be late, not on a tick."""

from __future__ import annotations

import io

import pytest

from otel_gpu.sampling.worker import FrameWriter, HangMonitor

pytestmark = pytest.mark.unit


class Stuck:
    def __init__(self) -> None:
        self.held = 0.0

    def stuck_seconds(self) -> float:
        return self.held


def monitor(limit: float) -> HangMonitor:
    # Its thread first sleeps a twentieth of a huge limit: it never acts during the test.
    m = HangMonitor(1e6, FrameWriter(io.BytesIO()))
    m.busy_since = None
    m.hang_after_s = limit
    return m


def test_it_wakes_when_the_running_sweep_would_be_late_and_not_sooner() -> None:
    m = monitor(10.0)
    assert m._next_check_s(100.0) == 10.0  # between sweeps: one limit
    m.busy_since = 97.0
    assert m._next_check_s(100.0) == 7.0  # the sweep begun at 97 is late at 107
    m.busy_since = 90.2
    assert m._next_check_s(100.0) == 0.5  # almost late: a twentieth of the limit at least
    m.busy_since = 50.0
    assert m._next_check_s(100.0) == 0.5  # already late: looked at again soon


def test_a_stuck_nvml_call_brings_the_check_forward() -> None:
    m = monitor(10.0)
    stuck = Stuck()
    m.source = stuck  # type: ignore[assignment]
    m.busy_since = 99.0
    assert m._next_check_s(100.0) == 9.0
    stuck.held = 4.0
    assert m._next_check_s(100.0) == 6.0  # the call is late 6 s from now
