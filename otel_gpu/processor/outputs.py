"""What the processor itself sends downstream: alerts and transitions as OTLP log records, and
detector metrics (contract names in docs/metrics.md's tables):

- ``otel_gpu.leak.rate`` (gauge, By/s) and ``otel_gpu.memory.time_to_exhaustion`` (gauge, s):
  the engine's current estimates while the subject's leak is active (counting down with the
  data), absent once it cleared;
- ``otel_gpu.breaker.state`` (gauge, 1): 0 closed, 1 half-open, 2 open, for every subject the
  breaker knows (subjects that never alerted are closed and not listed);
- ``otel_gpu.alerts`` (cumulative monotonic sum, {alert}): alerts per subject and kind.

Each output sits under a resource holding the reporter's identity attributes (service.*,
host.*, process.pid ...), with the subject's identity on the point (``otel_gpu.subject.kind``,
hw.id / process.pid and ``otel_gpu.subject``, see detect/subject.py): the attributes the agent
gives the same subject, so dashboards join them with the agent's own series.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import (
    SEVERITY_NUMBER_ERROR,
    SEVERITY_NUMBER_INFO,
    SEVERITY_NUMBER_WARN,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

from otel_gpu import __version__
from otel_gpu.core.redact import redact_text
from otel_gpu.core.signals import (
    ALERT_CONFIDENCE,
    ALERT_EVENT,
    ALERT_EVIDENCE,
    ALERT_KIND,
    ALERT_SEVERITY,
    ALERT_TIME,
    ALERT_WINDOW,
    ALERTS,
    BREAKER_EPISODE,
    BREAKER_FROM,
    BREAKER_STATE,
    BREAKER_TO,
    LEAK_RATE,
    TIME_TO_EXHAUSTION,
    TRANSITION_EVENT,
    Signal,
)
from otel_gpu.detect.breaker import OPEN, Transition
from otel_gpu.detect.model import Alert

SCOPE_NAME = "otel_gpu.processor"

Attrs = Sequence[tuple[str, object]]


@dataclass(frozen=True, slots=True)
class SubjectOutput:
    """Attributes of one subject's outputs: resource identity and point attributes."""

    resource: tuple[tuple[str, object], ...]
    attrs: tuple[tuple[str, object], ...]


@dataclass(frozen=True, slots=True)
class DetectorValues:
    """One subject's detector metrics at one export."""

    subject: SubjectOutput
    breaker_state: int | None  # None: not known to the breaker
    leak_rate: float | None
    time_to_exhaustion: float | None
    alerts_by_kind: dict[str, int]


def _value(v: object) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


def _kvs(attrs: Iterable[tuple[str, object]]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_value(v)) for k, v in attrs if v is not None]


def _group(items: Iterable[tuple[SubjectOutput, object]]) -> dict[tuple, list]:
    groups: dict[tuple, list] = {}
    for subject, item in items:
        groups.setdefault(subject.resource, []).append((subject, item))
    return groups


def alert_attributes(alert: Alert) -> list[tuple[str, object]]:
    """Log-record attributes of an alert (evidence flattened under otel_gpu.alert.evidence.*)."""
    attrs: list[tuple[str, object]] = [
        (ALERT_KIND, alert.kind),
        (ALERT_SEVERITY, alert.severity),
        (ALERT_TIME, float(alert.time)),
        (LEAK_RATE.name, alert.rate_bytes_per_s),
        (TIME_TO_EXHAUSTION.name, alert.eta_s),
        (ALERT_WINDOW, alert.window_s),
        (ALERT_CONFIDENCE, alert.confidence),
    ]
    attrs.extend((ALERT_EVIDENCE + k, v) for k, v in sorted(alert.evidence.items()))
    return attrs


def logs_request(
    alerts: Iterable[tuple[SubjectOutput, Alert]],
    transitions: Iterable[tuple[SubjectOutput, Transition]],
    now_ns: int,
) -> bytes:
    """Alerts and breaker transitions as one ExportLogsServiceRequest (encoded)."""
    req = ExportLogsServiceRequest()
    items: list[tuple[SubjectOutput, object]] = [*alerts, *transitions]
    for resource, entries in _group(items).items():
        rl = req.resource_logs.add()
        rl.resource.attributes.extend(_kvs(resource))
        sl = rl.scope_logs.add()
        sl.scope.name, sl.scope.version = SCOPE_NAME, __version__
        for subject, item in entries:
            rec = sl.log_records.add()
            rec.observed_time_unix_nano = now_ns
            rec.attributes.extend(_kvs(subject.attrs))
            if isinstance(item, Alert):
                rec.time_unix_nano = int(item.time * 1e9)
                rec.event_name = ALERT_EVENT
                critical = item.severity == "critical"
                rec.severity_number = SEVERITY_NUMBER_ERROR if critical else SEVERITY_NUMBER_WARN
                rec.severity_text = "ERROR" if critical else "WARN"
                rec.body.string_value = redact_text(item.message)
                rec.attributes.extend(_kvs(alert_attributes(item)))
            elif isinstance(item, Transition):
                rec.time_unix_nano = int(item.time * 1e9)
                rec.event_name = TRANSITION_EVENT
                opened = item.to_state == OPEN
                rec.severity_number = SEVERITY_NUMBER_WARN if opened else SEVERITY_NUMBER_INFO
                rec.severity_text = "WARN" if opened else "INFO"
                rec.body.string_value = redact_text(item.reason)
                extra = [
                    (BREAKER_FROM, item.from_state),
                    (BREAKER_TO, item.to_state),
                    (BREAKER_EPISODE, item.episode),
                ]
                if item.alert is not None:
                    extra.append((ALERT_KIND, item.alert.kind))
                rec.attributes.extend(_kvs(extra))
    return req.SerializeToString()


def _metric(scope_metrics: Any, signal: Signal) -> Any:
    """An empty metric of ``signal``'s name, unit and description in ``scope_metrics``."""
    return scope_metrics.metrics.add(
        name=signal.name, unit=signal.unit, description=signal.description
    )


def metrics_request(values: Sequence[DetectorValues], start_ns: int, now_ns: int) -> bytes:
    """Detector metrics for ``values`` as one ExportMetricsServiceRequest (encoded)."""
    req = ExportMetricsServiceRequest()
    for resource, entries in _group((v.subject, v) for v in values).items():
        rm = req.resource_metrics.add()
        rm.resource.attributes.extend(_kvs(resource))
        sm = rm.scope_metrics.add()
        sm.scope.name, sm.scope.version = SCOPE_NAME, __version__
        leak, eta, state, alerts = (
            _metric(sm, s) for s in (LEAK_RATE, TIME_TO_EXHAUSTION, BREAKER_STATE, ALERTS)
        )
        alerts.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
        alerts.sum.is_monotonic = True
        for _, v in entries:
            attrs = _kvs(v.subject.attrs)
            for metric, value in (
                (leak, v.leak_rate),
                (eta, v.time_to_exhaustion),
                (state, v.breaker_state),
            ):
                if value is None:
                    continue
                dp = metric.gauge.data_points.add(time_unix_nano=now_ns)
                if isinstance(value, int):
                    dp.as_int = value
                else:
                    dp.as_double = float(value)
                dp.attributes.extend(attrs)
            for kind, count in sorted(v.alerts_by_kind.items()):
                dp = alerts.sum.data_points.add(
                    start_time_unix_nano=start_ns, time_unix_nano=now_ns, as_int=count
                )
                dp.attributes.extend(attrs)
                dp.attributes.append(KeyValue(key=ALERT_KIND, value=_value(kind)))
        # An OTLP metric must carry data: drop the ones this resource has no points for.
        keep = [m for m in sm.metrics if m.gauge.data_points or m.sum.data_points]
        del sm.metrics[:]
        sm.metrics.extend(keep)
    return req.SerializeToString()
