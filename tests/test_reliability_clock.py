"""docs/reliability.md case 33, clock jumps (an NTP step backwards or forwards): intervals and
freshness run on monotonic time, timestamps on wall time, and nothing comes out negative.
The clocks are injected where the code takes them (Sampler's ``clock`` / ``monotonic``)."""

from __future__ import annotations

import threading
import time

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import instruments as metrics
from otel_gpu.agent import selfmetrics
from otel_gpu.agent.selfmetrics import ExportHealth
from otel_gpu.sampling.sampler import Sampler

pytestmark = pytest.mark.unit

HOUR = 3600.0
T0 = 1_764_410_000.0  # a wall-clock time (Unix s)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _values(reader: InMemoryMetricReader) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(p.value for p in m.data.data_points)
    return out


@pytest.mark.parametrize("jump_s", [-HOUR, -1.0, +1.0, +HOUR], ids=["-1h", "-1s", "+1s", "+1h"])
def test_a_wall_clock_step_changes_timestamps_only(fake_nvml: FakeNvml, jump_s: float) -> None:
    wall, mono = Clock(T0), Clock(500.0)
    sampler = Sampler(fake_nvml.source(), None, interval_s=1.0, clock=wall, monotonic=mono)
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    metrics.register(meter, sampler.fresh)
    selfmetrics.register(meter, sampler, ExportHealth(clock=mono))
    assert sampler.sample_once().time == T0
    wall.now += jump_s  # NTP steps the wall clock; monotonic time goes on (0.5 s later)
    mono.now += 0.5
    got = _values(reader)
    # Still fresh: half an interval old, however far the wall clock moved.
    assert got["hw.power"] == [70.0, 70.0]
    assert got["otel_gpu.agent.snapshot.age"] == [0.5]
    snap = sampler.sample_once()
    assert snap.time == T0 + jump_s  # the data's timestamp is wall time, stepped as it is
    assert sampler.age() == 0.0


def test_sweeps_keep_their_pace_while_the_wall_clock_keeps_stepping_back(
    fake_nvml: FakeNvml,
) -> None:
    """The sampler's thread paces itself on monotonic time: a wall clock that steps back an
    hour at every reading does not make it wait for those hours to pass again."""
    lock = threading.Lock()
    calls = [0]

    def stepping_wall() -> float:
        with lock:
            calls[0] += 1
            return T0 - HOUR * calls[0]

    sampler = Sampler(fake_nvml.source(), None, interval_s=0.1, clock=stepping_wall)
    stamps: list[float] = []
    sampler.add_listener(lambda snap: stamps.append(snap.time))
    sampler.start()
    time.sleep(1.0)
    sampler.stop()
    # About ten sweeps at 0.1 s; generous bounds for a loaded machine.
    assert 4 <= len(stamps) <= 30, len(stamps)
    assert stamps == sorted(stamps, reverse=True)  # stamped by the (stepping) wall clock


def test_export_failure_age_is_never_negative() -> None:
    mono = Clock(100.0)
    health = ExportHealth(clock=mono)
    health.record(False, 10)
    mono.now -= 5.0  # an injected clock that steps back (the default one never does)
    assert health.failing_for() == 0.0
    mono.now += 65.0
    assert health.failing_for() == 60.0
