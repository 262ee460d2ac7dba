"""otel_gpu.MemTracker (otel_gpu/tracing/memtracker.py): counters sampled on its own thread,
peaks per phase and step, the threshold, a context manager, top holders (issue 20 §5)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import otel_gpu
from otel_gpu.tracing import progress

pytestmark = pytest.mark.unit


def test_peaks_per_phase_and_step_and_samples_over_the_threshold(
    caplog: pytest.LogCaptureFixture,
) -> None:
    values = iter([100e6, 300e6, 9000e6, 200e6, 50e6])
    tracker = otel_gpu.MemTracker(
        interval_ms=10_000, alert_threshold_mb=8000, read=lambda: (v := next(values), v, v)
    )
    saved = progress.current_step()
    token = progress.push_phase("train")
    try:
        progress.set_step(1)
        tracker.sample()
        tracker.sample()
        progress.set_step(2)
        with caplog.at_level(logging.WARNING, "otel_gpu.tracing"):
            tracker.sample()
        progress.set_step(3)
        tracker.sample()
        progress.pop_phase(token)
        token = None
        tracker.sample()  # out of the phase, still step 3
    finally:
        progress.pop_phase(token)
        if saved is not None:  # the step is process-wide: an earlier test's is put back
            progress.set_step(saved)
    report = tracker.report(holders=False)
    assert report["peak_bytes"] == 9000e6 and report["samples"] == 5
    assert report["peak_by_step"] == {1: 300e6, 2: 9000e6, 3: 200e6}
    assert report["peak_by_phase"]["train"] == 9000e6
    assert [(o["bytes"], o["step"]) for o in report["over_threshold"]] == [(9000e6, 2)]
    assert "over 8000 MB (phase train, step 2)" in caplog.text


def test_as_a_context_manager_it_samples_rss_on_its_thread_and_names_holders() -> None:
    keep = [torch.zeros(1000) for _ in range(10)]
    with otel_gpu.MemTracker(interval_ms=10) as tracker:
        time.sleep(0.3)
    assert tracker.source == "rss"  # a CPU build
    report = tracker.report()
    assert report["samples"] >= 5 and report["interval_ms"] == 10
    assert report["peak_bytes"] > 10e6
    assert any(h["path"] == "keep" and h["count"] == 10 for h in report["holders"]), report
    n = report["samples"]
    time.sleep(0.05)
    assert tracker.report(holders=False)["samples"] == n  # stopped
    del keep


def test_the_interval_is_bounded_at_100_hz() -> None:
    assert otel_gpu.MemTracker(interval_ms=1).interval_s == 0.01
