"""Telling why a run stopped: a span event, an OTel log record and a stderr line."""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace
from opentelemetry._logs import SeverityNumber, get_logger

from otel_gpu.core.redact import redact_text
from otel_gpu.tracing.control import StopDecision

log = logging.getLogger("otel_gpu.stop")

STOP_EVENT = "otel_gpu.stop"


def record_stop(run: Any, decision: StopDecision, step: int) -> None:
    """Record that the ranks agreed to checkpoint and stop at ``step``; never raises."""
    reason = redact_text(decision.reason)  # free text from request_stop(), maybe an alert's
    attrs = {
        "otel_gpu.stop.reason": reason,
        "otel_gpu.stop.requested_by_rank": decision.requested_by,
        "training.step": step,
        **run.rank.attributes(),
    }
    message = f"otel-gpu: saving a checkpoint and stopping at step {step}: {reason}"
    log.warning(message)
    try:
        run.event(STOP_EVENT, attrs)
        ctx = trace.set_span_in_context(run.train_span) if run.train_span is not None else None
        get_logger("otel_gpu.stop").emit(
            severity_number=SeverityNumber.WARN,
            severity_text="WARN",
            body=message,
            attributes=attrs,
            event_name=STOP_EVENT,
            context=ctx,
        )
    except Exception as exc:
        log.debug("stop record not emitted: %s", exc)
