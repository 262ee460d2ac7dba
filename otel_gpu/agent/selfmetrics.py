"""The agent's own health: ``otel_gpu.agent.*`` self-metrics and the export outcome they read.

An agent that has gone blind must say so. These instruments report how fresh sampling is, what
it costs, what NVML refused and what the exporter could not deliver; ``/healthz``
(:mod:`otel_gpu.agent.health`) reads the same state. Callbacks read counters kept by the sampler and
by :class:`CountingExporter` only: no NVML, no /proc.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otel_gpu.core import signals as sig
from otel_gpu.core.export_log import count_points
from otel_gpu.core.signals import Signal, observable
from otel_gpu.sampling.snapshot import Snapshot


class SamplingState(Protocol):
    """What the self-metrics read of a sampler (thread or helper process)."""

    restarts: int
    stale_after_s: float

    @property
    def latest(self) -> Snapshot | None: ...

    def fresh(self) -> Snapshot | None: ...

    def age(self) -> float: ...

    def nvml_errors(self) -> dict[str, int]: ...


class ExportHealth:
    """Outcome of metric exports: counts, since when they have been failing, and when the last
    one ended (an export thread that is stuck or gone ends none)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.exports = 0
        self.failures = 0
        self.dropped_points = 0
        self.rejected_points = 0  # in partial successes: the collector took the rest
        self.failing_since: float | None = None  # monotonic time of the first failure in a row
        # Set when a push exporter starts (console, OTLP), then at the end of each export.
        self.last_ended: float | None = None

    def pushing(self) -> None:
        """A push exporter counts into this from now on (the start of the stall clock)."""
        with self._lock:
            if self.last_ended is None:
                self.last_ended = self._clock()

    def record(self, ok: bool, points: int) -> None:
        with self._lock:
            self.exports += 1
            self.last_ended = self._clock()
            if ok:
                self.failing_since = None
                return
            self.failures += 1
            self.dropped_points += points
            if self.failing_since is None:
                self.failing_since = self._clock()

    def record_rejected(self, points: int) -> None:
        with self._lock:
            self.rejected_points += points

    def failing_for(self) -> float:
        """Seconds exports have been failing without a success in between (0: not failing)."""
        since = self.failing_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def idle_for(self) -> float | None:
        """Seconds since the last export ended (since the push exporter started before the
        first); None without a push exporter."""
        last = self.last_ended
        return None if last is None else max(0.0, self._clock() - last)


class CountingExporter(MetricExporter):
    """Wraps a metric exporter and records each export's outcome in an :class:`ExportHealth`."""

    def __init__(self, inner: MetricExporter, health: ExportHealth) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._health = health

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            result = MetricExportResult.FAILURE
        ok = result == MetricExportResult.SUCCESS
        self._health.record(ok, 0 if ok else count_points(metrics_data))
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


@dataclass(frozen=True)
class SelfInstrument:
    """A self-metric of the contract (``otel_gpu.core.signals.agent``) and its reader."""

    signal: Signal
    read: Callable[[SamplingState, ExportHealth], Iterable[Observation]]

    @property
    def name(self) -> str:
        return self.signal.name


def _sweep_duration(s: SamplingState, _e: ExportHealth) -> Iterable[Observation]:
    snap = s.fresh()
    if snap is not None and snap.sweep_seconds is not None:
        yield Observation(snap.sweep_seconds)


def _gpu_read_duration(s: SamplingState, _e: ExportHealth) -> Iterable[Observation]:
    snap = s.fresh()
    for g in snap.gpus if snap is not None else ():
        if g.read_seconds is not None:
            yield Observation(g.read_seconds, {sig.HW_ID: g.uuid})


def _snapshot_age(s: SamplingState, _e: ExportHealth) -> Iterable[Observation]:
    yield Observation(s.age())


def _nvml_errors(s: SamplingState, _e: ExportHealth) -> Iterable[Observation]:
    for name, count in sorted(s.nvml_errors().items()):
        yield Observation(count, {sig.ERROR_TYPE: name})


def _sampling_intervals(s: SamplingState, _e: ExportHealth) -> Iterable[Observation]:
    snap = s.fresh()
    for read, seconds in snap.intervals if snap is not None else ():
        yield Observation(seconds, {sig.AGENT_READ: read})


INSTRUMENTS: Sequence[SelfInstrument] = (
    SelfInstrument(sig.AGENT_SWEEP_DURATION, _sweep_duration),
    SelfInstrument(sig.AGENT_GPU_READ_DURATION, _gpu_read_duration),
    SelfInstrument(sig.AGENT_SNAPSHOT_AGE, _snapshot_age),
    SelfInstrument(sig.AGENT_NVML_ERRORS, _nvml_errors),
    SelfInstrument(sig.AGENT_SAMPLING_INTERVAL, _sampling_intervals),
    SelfInstrument(sig.AGENT_SAMPLER_RESTARTS, lambda s, _e: [Observation(s.restarts)]),
    SelfInstrument(sig.AGENT_EXPORT_FAILURES, lambda _s, e: [Observation(e.failures)]),
    SelfInstrument(sig.AGENT_EXPORT_DROPPED_POINTS, lambda _s, e: [Observation(e.dropped_points)]),
    SelfInstrument(
        sig.AGENT_EXPORT_REJECTED_POINTS, lambda _s, e: [Observation(e.rejected_points)]
    ),
)


def register(meter: Meter, sampling: SamplingState, exports: ExportHealth) -> list[Any]:
    """Create the self-metric instruments; callbacks return nothing in a forked child. A
    reader that raises is logged once per episode (otel_gpu.core.signals.reading)."""
    owner = os.getpid()
    created = []
    for spec in INSTRUMENTS:

        def callback(options: CallbackOptions, spec: SelfInstrument = spec) -> list[Observation]:
            if os.getpid() != owner:
                return []
            return list(spec.read(sampling, exports))

        created.append(observable(meter, spec.signal, [callback]))
    return created
