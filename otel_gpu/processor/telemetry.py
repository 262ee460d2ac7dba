"""The processor's own telemetry as OTLP metrics, sent downstream with the data (the way the
Collector exports its ``otelcol_*`` metrics), from a :meth:`Processor.stats` snapshot.

Counters are cumulative since start: requests accepted and refused per signal, data points the
decoder accepted, rejected and counted as overflow, requests each downstream delivered and
dropped (per signal) and items it reported rejected (``partial_success``), state-store errors. Gauges: each
forward queue's length and bytes, resident memory and whether the memory limiter refuses.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE, Metric

from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT, TRACE_EXPORT

SIGNALS = {METRICS_EXPORT: "metrics", TRACE_EXPORT: "traces", LOGS_EXPORT: "logs"}
PREFIX = "otel_gpu.processor."


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


class _Builder:
    def __init__(self, start_ns: int, now_ns: int) -> None:
        self.req = ExportMetricsServiceRequest()
        rm = self.req.resource_metrics.add()
        rm.resource.attributes.append(_kv("service.name", "otel-gpu-processor"))
        self._sm = rm.scope_metrics.add()
        self._sm.scope.name = "otel_gpu.processor"
        self._metrics: dict[str, Metric] = {}
        self._start, self._now = start_ns, now_ns

    def _metric(self, name: str, unit: str, desc: str, counter: bool) -> Metric:
        m = self._metrics.get(name)
        if m is None:
            m = self._metrics[name] = self._sm.metrics.add(
                name=PREFIX + name, unit=unit, description=desc
            )
            if counter:
                m.sum.is_monotonic = True
                m.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
        return m

    def add(
        self, name: str, unit: str, desc: str, value: float, counter: bool = True, **attrs: str
    ) -> None:
        m = self._metric(name, unit, desc, counter)
        points = m.sum.data_points if counter else m.gauge.data_points
        dp = points.add(time_unix_nano=self._now)
        if counter:
            dp.start_time_unix_nano = self._start
        if isinstance(value, int):
            dp.as_int = value
        else:
            dp.as_double = value
        for k, v in attrs.items():
            dp.attributes.append(_kv(k.replace("_", "."), v))


def self_metrics_request(stats: dict[str, Any], start_ns: int, now_ns: int | None = None) -> bytes:
    """An encoded ExportMetricsServiceRequest of the processor's counters and gauges."""
    b = _Builder(start_ns, time.time_ns() if now_ns is None else now_ns)
    for signal, counts in stats.get("signals", {}).items():
        for outcome in ("accepted", "refused"):
            b.add(
                f"requests.{outcome}",
                "{request}",
                f"export requests {outcome}, per signal",
                int(counts[outcome]),
                signal=signal,
            )
    det = stats.get("detection", {})
    for key, desc in (
        ("points", "routed data points accepted"),
        ("rejected", "routed data points rejected (NaN, inf, bad timestamps)"),
        ("overflow", "data points of subjects refused by the series caps"),
    ):
        b.add(f"points.{key}", "{point}", desc, int(det.get(key, 0)))
    b.add("subjects", "{subject}", "detection subjects tracked", int(det.get("subjects", 0)), False)
    for target, f in stats.get("forward", {}).items():
        b.add("forward.sent", "{request}", "requests delivered downstream", int(f["sent"]),
              downstream=target)  # fmt: skip
        for signal in SIGNALS.values():
            b.add(
                "forward.dropped",
                "{request}",
                "requests lost for this downstream (counted, never silent)",
                int(f["dropped_by_signal"].get(signal, 0)),
                downstream=target,
                signal=signal,
            )
        b.add(
            "forward.partial_rejected",
            "{item}",
            "items the downstream rejected in partial_success",
            int(f["partial_rejected"]),
            downstream=target,
        )
        b.add("forward.queue.size", "{request}", "requests queued", int(f["queued"]), False,
              downstream=target)  # fmt: skip
        b.add("forward.queue.bytes", "By", "bytes queued", int(f["queued_bytes"]), False,
              downstream=target)  # fmt: skip
    store = stats.get("store", {})
    b.add("store.errors", "{error}", "state store write failures", int(store.get("errors", 0)))
    mem = stats.get("memory", {})
    b.add("memory.usage", "By", "resident memory", int(mem.get("rss_bytes", 0)), False)
    b.add("memory.limited", "1", "1 while refusing for memory", int(bool(mem.get("limited"))),
          False)  # fmt: skip
    return b.req.SerializeToString()  # type: ignore[no-any-return]
