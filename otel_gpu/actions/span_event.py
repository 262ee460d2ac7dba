"""Alerts as events on the job's current span.

The agent runs on its own thread, where ``trace.get_current_span()`` is not the job's span. The
tracing side therefore registers the span it considers current (``set_job_span``, e.g. from a
Trainer callback at train/step begin) and the actions add events to it from any thread; the SDK
span's ``add_event`` takes its own lock, so this is safe and cheap (no I/O).
"""

from __future__ import annotations

import math
import threading

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from otel_gpu.core.redact import redact_text
from otel_gpu.core.signals import (
    ALERT_CONFIDENCE,
    ALERT_DIAGNOSIS,
    ALERT_DIAGNOSIS_KIND,
    ALERT_EVENT,
    ALERT_KIND,
    ALERT_MESSAGE,
    ALERT_SEVERITY,
    ALERT_SUBJECT,
    ALERT_TIME,
    ALERT_WINDOW,
    LEAK_RATE,
    TIME_TO_EXHAUSTION,
)
from otel_gpu.detect.model import Alert

DIAGNOSIS_LINES = 5  # lines of an alert's diagnosis on its span event (bounded attributes)

_lock = threading.Lock()
_job_span: trace.Span | None = None


def set_job_span(span: trace.Span | None) -> None:
    """Register the job's current span (None to clear, e.g. when it ends)."""
    global _job_span
    with _lock:
        _job_span = span


def get_job_span() -> trace.Span | None:
    """The registered span, or None."""
    with _lock:
        return _job_span


def alert_attributes(alert: Alert) -> dict[str, AttributeValue]:
    """Event attributes for ``alert`` (credentials masked); unknown values are left out, never
    written as 0."""
    attrs: dict[str, AttributeValue] = {
        ALERT_KIND: alert.kind,
        ALERT_SUBJECT: redact_text(alert.subject),
        ALERT_SEVERITY: alert.severity,
        ALERT_MESSAGE: redact_text(alert.message),
        ALERT_TIME: alert.time,
    }
    optional = (
        (LEAK_RATE.name, alert.rate_bytes_per_s),
        (TIME_TO_EXHAUSTION.name, alert.eta_s),
        (ALERT_WINDOW, alert.window_s),
        (ALERT_CONFIDENCE, alert.confidence),
    )
    for key, value in optional:
        if value is not None and math.isfinite(value):
            attrs[key] = float(value)
    if alert.diagnosis is not None:
        attrs[ALERT_DIAGNOSIS_KIND] = alert.diagnosis.kind
        shown = alert.diagnosis.shown(DIAGNOSIS_LINES)
        if shown:
            attrs[ALERT_DIAGNOSIS] = tuple(redact_text(line) for line in shown)
    return attrs


def add_alert_event(alert: Alert, span: trace.Span | None = None) -> bool:
    """Add an ``otel_gpu.alert`` event to ``span``, else the registered job span, else the
    calling thread's current span. Returns True if a recording span took it. Never raises.
    """
    target = span or get_job_span() or trace.get_current_span()
    try:
        if not target.is_recording():
            return False
        target.add_event(ALERT_EVENT, attributes=alert_attributes(alert))
        return True
    except Exception:
        return False
