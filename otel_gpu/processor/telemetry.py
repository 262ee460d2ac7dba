"""The processor's own telemetry as OTLP metrics, sent downstream with the data (the way the
Collector exports its ``otelcol_*`` metrics), from a :meth:`Processor.stats` snapshot.

The signals are declared in the contract (``otel_gpu.core.signals.processor``). Counters are
cumulative since start: requests accepted and refused per signal, data points the decoder
accepted, rejected and counted as overflow, requests each downstream delivered and dropped (per
signal) and items it reported rejected (``partial_success``), state-store errors. Gauges:
subjects tracked, each forward queue's length and bytes, resident memory and whether the memory
limiter refuses.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE, Metric

from otel_gpu.core import signals as sig
from otel_gpu.core.signals import GAUGE, Signal
from otel_gpu.processor.outputs import SCOPE_NAME
from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT, TRACE_EXPORT

SIGNALS = {METRICS_EXPORT: "metrics", TRACE_EXPORT: "traces", LOGS_EXPORT: "logs"}


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


class _Builder:
    def __init__(self, start_ns: int, now_ns: int) -> None:
        self.req = ExportMetricsServiceRequest()
        rm = self.req.resource_metrics.add()
        rm.resource.attributes.append(_kv("service.name", "otel-gpu-processor"))
        self._sm = rm.scope_metrics.add()
        self._sm.scope.name = SCOPE_NAME
        self._metrics: dict[str, Metric] = {}
        self._start, self._now = start_ns, now_ns

    def _metric(self, signal: Signal) -> Metric:
        m = self._metrics.get(signal.name)
        if m is None:
            m = self._metrics[signal.name] = self._sm.metrics.add(
                name=signal.name, unit=signal.unit, description=signal.description
            )
            if signal.kind != GAUGE:
                m.sum.is_monotonic = signal.kind == sig.COUNTER
                m.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
        return m

    def add(self, signal: Signal, value: float, attrs: dict[str, str] | None = None) -> None:
        """One point of ``signal``; ``attrs`` keys are the contract's attribute keys."""
        m = self._metric(signal)
        gauge = signal.kind == GAUGE
        dp = (m.gauge if gauge else m.sum).data_points.add(time_unix_nano=self._now)
        if not gauge:
            dp.start_time_unix_nano = self._start
        if isinstance(value, int):
            dp.as_int = value
        else:
            dp.as_double = value
        for k, v in (attrs or {}).items():
            dp.attributes.append(_kv(k, v))


def self_metrics_request(stats: dict[str, Any], start_ns: int, now_ns: int | None = None) -> bytes:
    """An encoded ExportMetricsServiceRequest of the processor's counters and gauges."""
    b = _Builder(start_ns, time.time_ns() if now_ns is None else now_ns)
    for signal, counts in stats.get("signals", {}).items():
        on = {sig.OTLP_SIGNAL: signal}
        b.add(sig.PROCESSOR_REQUESTS_ACCEPTED, int(counts["accepted"]), on)
        b.add(sig.PROCESSOR_REQUESTS_REFUSED, int(counts["refused"]), on)
    det = stats.get("detection", {})
    b.add(sig.PROCESSOR_POINTS_ACCEPTED, int(det.get("points", 0)))
    b.add(sig.PROCESSOR_POINTS_REJECTED, int(det.get("rejected", 0)))
    b.add(sig.PROCESSOR_POINTS_OVERFLOW, int(det.get("overflow", 0)))
    b.add(sig.PROCESSOR_SUBJECTS, int(det.get("subjects", 0)))
    for target, f in stats.get("forward", {}).items():
        to = {sig.DOWNSTREAM: target}
        b.add(sig.PROCESSOR_FORWARD_SENT, int(f["sent"]), to)
        for signal in SIGNALS.values():
            dropped = int(f["dropped_by_signal"].get(signal, 0))
            b.add(sig.PROCESSOR_FORWARD_DROPPED, dropped, {**to, sig.OTLP_SIGNAL: signal})
        b.add(sig.PROCESSOR_FORWARD_PARTIAL_REJECTED, int(f["partial_rejected"]), to)
        b.add(sig.PROCESSOR_QUEUE_SIZE, int(f["queued"]), to)
        b.add(sig.PROCESSOR_QUEUE_BYTES, int(f["queued_bytes"]), to)
    b.add(sig.PROCESSOR_STORE_ERRORS, int(stats.get("store", {}).get("errors", 0)))
    mem = stats.get("memory", {})
    b.add(sig.PROCESSOR_MEMORY_USAGE, int(mem.get("rss_bytes", 0)))
    b.add(sig.PROCESSOR_MEMORY_LIMITED, int(bool(mem.get("limited"))))
    return b.req.SerializeToString()  # type: ignore[no-any-return]
