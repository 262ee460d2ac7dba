"""A reader that raises, in any instrument's callback, is logged once per episode: its first
failure (with where it failed), nothing while it keeps failing, a line when it reads again. Its
instrument's points are left out of that collection, never the other instruments' points.

Through the real SDK (InMemoryMetricReader): the SDK itself would log a traceback on every
collection of a raising callback, which is what the guard in ``otel_gpu.core.signals.reading``
replaces."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import instruments, selfmetrics
from otel_gpu.agent.instruments import Instrument
from otel_gpu.agent.selfmetrics import ExportHealth
from otel_gpu.core import signals as sig
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.sim import SimulatedSource
from otel_gpu.sampling.snapshot import GpuSample, Snapshot

UUID = "GPU-5e1f4c2a-9b7d-4e3f-8a1b-000000000000"
SNAP = Snapshot(time=1.0, gpus=(GpuSample(uuid=UUID, index=0, power_w=300.0, memory_used=1),))


class Flaky:
    """A reader's fault switched on and off by the test: ``broken`` raises as a bug would."""

    def __init__(self) -> None:
        self.broken = False

    def check(self) -> None:
        if self.broken:
            raise KeyError("hw.id of GPU-5e1f... password=hunter2")


class Collected:
    def __init__(self, register: Callable[[Any], object]) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        register(self.provider.get_meter("t"))

    def names(self) -> set[str]:
        data = self.reader.get_metrics_data()
        return {
            m.name
            for rm in (data.resource_metrics if data else ())
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.data.data_points
        }


pytestmark = pytest.mark.unit


def _row(signal: sig.Signal) -> Instrument:
    return next(i for i in instruments.INSTRUMENTS if i.signal == signal)


def _instrument_table(flaky: Flaky) -> tuple[Callable[[Any], object], str, str]:
    def power(snap: Snapshot) -> Iterator[Observation]:
        flaky.check()
        yield from _row(sig.GPU_POWER).read(snap)

    table = (Instrument(sig.GPU_POWER, power), _row(sig.GPU_MEMORY_USAGE))
    return (
        lambda meter: instruments.register(meter, lambda: SNAP, table),
        sig.GPU_POWER.name,
        sig.GPU_MEMORY_USAGE.name,
    )


def _self_metrics(flaky: Flaky) -> tuple[Callable[[Any], object], str, str]:
    class Sampling(Sampler):
        def nvml_errors(self) -> dict[str, int]:
            flaky.check()
            return super().nvml_errors()

    sampler = Sampling(SimulatedSource(), None, interval_s=1.0)
    sampler.publish(replace(SNAP, nvml_errors=(("TIMEOUT", 1),)))
    return (
        lambda meter: selfmetrics.register(meter, sampler, ExportHealth()),
        sig.AGENT_NVML_ERRORS.name,
        sig.AGENT_SNAPSHOT_AGE.name,
    )


def _any_instrument(flaky: Flaky) -> tuple[Callable[[Any], object], str, str]:
    def broken(_options: CallbackOptions) -> Iterable[Observation]:
        flaky.check()
        yield Observation(1.0)

    def fine(_options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(2.0)

    def register(meter: Any) -> None:
        sig.observable(meter, sig.TRAINING_STEP, [broken])
        sig.observable(meter, sig.TORCH_PEAK, [fine])

    return register, sig.TRAINING_STEP.name, sig.TORCH_PEAK.name


def _said(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the guard and the SDK's metrics logged (not other tests' leftover threads)."""
    return [r for r in caplog.records if r.name.startswith(READER_LOGGERS)]


READER_LOGGERS = ("otel_gpu.signals", "opentelemetry.sdk.metrics")


@pytest.mark.parametrize(
    "setup", [_instrument_table, _self_metrics, _any_instrument], ids=lambda f: f.__name__[1:]
)
def test_a_failing_reader_is_logged_once_per_episode(
    setup: Callable[[Flaky], tuple[Callable[[Any], object], str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    flaky = Flaky()
    register, failing, other = setup(flaky)
    collected = Collected(register)
    caplog.set_level(logging.INFO)

    assert {failing, other} <= collected.names()
    assert not _said(caplog)

    flaky.broken = True
    for _ in range(3):  # three collections, one episode
        names = collected.names()
        assert failing not in names and other in names  # only its own points are lost
    said = [(r.name, r.levelno, r.getMessage()) for r in _said(caplog)]
    assert len(said) == 1, said  # neither silent nor once per collection (nor the SDK's lines)
    name, level, message = said[0]
    assert (name, level) == ("otel_gpu.signals", logging.WARNING)
    assert failing in message and "KeyError" in message and "test_signal_readers.py:" in message
    assert "hunter2" not in message  # the exception's text is redacted like any emitted string

    caplog.clear()
    flaky.broken = False
    assert failing in collected.names()
    assert [r.levelno for r in _said(caplog)] == [logging.INFO]
    assert "works again after 3 failed collections" in _said(caplog)[0].getMessage()

    caplog.clear()
    flaky.broken = True
    collected.names()
    collected.names()
    assert [r.levelno for r in _said(caplog)] == [logging.WARNING]  # a new episode
    collected.provider.shutdown()
