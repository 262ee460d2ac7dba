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

from otel_gpu.detect.model import Alert
from otel_gpu.redact import redact_text

EVENT_NAME = "otel_gpu.alert"

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
        "otel_gpu.alert.kind": alert.kind,
        "otel_gpu.alert.subject": redact_text(alert.subject),
        "otel_gpu.alert.severity": alert.severity,
        "otel_gpu.alert.message": redact_text(alert.message),
        "otel_gpu.alert.time": alert.time,
    }
    optional = (
        ("otel_gpu.leak.rate", alert.rate_bytes_per_s),  # By/s
        ("otel_gpu.memory.time_to_exhaustion", alert.eta_s),  # s
        ("otel_gpu.alert.window", alert.window_s),  # s
        ("otel_gpu.alert.confidence", alert.confidence),  # 0..1
    )
    for key, value in optional:
        if value is not None and math.isfinite(value):
            attrs[key] = float(value)
    return attrs


def add_alert_event(alert: Alert, span: trace.Span | None = None) -> bool:
    """Add an ``otel_gpu.alert`` event to ``span``, else the registered job span, else the
    calling thread's current span. Returns True if a recording span took it. Never raises.
    """
    target = span or get_job_span() or trace.get_current_span()
    try:
        if not target.is_recording():
            return False
        target.add_event(EVENT_NAME, attributes=alert_attributes(alert))
        return True
    except Exception:
        return False
