"""Span events on the job's span and transitions as OTel log records, with the real SDK."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_gpu.actions import ActionDispatcher, add_alert_event, set_job_span
from otel_gpu.core.signals import ALERT_EVENT
from otel_gpu.detect.breaker import Breaker, BreakerConfig
from otel_gpu.detect.model import LEAK, STALL, Alert

pytestmark = pytest.mark.unit

try:  # newer SDKs call it InMemoryLogRecordExporter; the old name warns
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter as MemoryLogs
except ImportError:  # pragma: no cover - older SDKs
    from opentelemetry.sdk._logs.export import InMemoryLogExporter as MemoryLogs  # type: ignore


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    set_job_span(None)
    provider.shutdown()


def leak(t: float = 50.0, eta: float | None = 7200.0) -> Alert:
    return Alert(
        LEAK, "gpu0", t, "critical", "memory grows 50 MB/h", rate_bytes_per_s=13_900.0, eta_s=eta
    )


def test_alert_lands_on_the_registered_job_span_from_the_agent_thread(spans) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    d = ActionDispatcher()  # no webhooks: log + span event only
    b = Breaker(BreakerConfig())
    with tracer.start_as_current_span("train") as span:
        set_job_span(span)
        # The agent runs detection on its own thread, where the job's span is not current.
        agent = threading.Thread(
            target=lambda: [d.on_transition(t) for t in b.record_alert(leak())]
        )
        agent.start()
        agent.join(5)
    (train,) = exporter.get_finished_spans()
    (event,) = train.events
    assert event.name == ALERT_EVENT
    assert dict(event.attributes or {}) == {
        "otel_gpu.alert.kind": LEAK,
        "otel_gpu.alert.subject": "gpu0",
        "otel_gpu.alert.severity": "critical",
        "otel_gpu.alert.message": "memory grows 50 MB/h",
        "otel_gpu.alert.time": 50.0,
        "otel_gpu.leak.rate": 13_900.0,
        "otel_gpu.memory.time_to_exhaustion": 7200.0,
    }


def test_unknown_values_are_left_out_and_ended_spans_refuse(spans) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    span = tracer.start_span("step")
    assert add_alert_event(leak(eta=None), span=span)
    span.end()
    assert not add_alert_event(leak(), span=span)  # ended: not recording
    (step,) = exporter.get_finished_spans()
    (event,) = step.events
    assert "otel_gpu.memory.time_to_exhaustion" not in (event.attributes or {})


def test_without_a_registered_span_the_current_one_is_used(spans) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = spans
    set_job_span(None)
    assert not add_alert_event(leak())  # no span anywhere: nothing, no error
    with provider.get_tracer("t").start_as_current_span("evaluate"):
        assert add_alert_event(leak())
    assert len(exporter.get_finished_spans()[0].events) == 1


def test_span_events_can_be_turned_off(spans) -> None:  # type: ignore[no-untyped-def]
    provider, exporter = spans
    d = ActionDispatcher(span_events=False)
    with provider.get_tracer("t").start_as_current_span("train") as span:
        set_job_span(span)
        for t in Breaker().record_alert(leak()):
            d.on_transition(t)
    assert exporter.get_finished_spans()[0].events == ()


# The SDK's LoggingHandler is what `opentelemetry-instrument` installs today; it warns that it
# moves to opentelemetry-instrumentation-logging.
@pytest.mark.filterwarnings("ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated")
def test_every_transition_becomes_an_otel_log_record() -> None:
    exporter = MemoryLogs()
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    handler = LoggingHandler(level=logging.INFO, logger_provider=provider)
    logger = logging.getLogger("otel_gpu.actions")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        d = ActionDispatcher(span_events=False)
        b = Breaker(BreakerConfig(cooldown_s=60, probation_s=60))
        for t in b.record_alert(
            Alert(STALL, "job", 0, "warning", "no steps for 10 min")
        ) + b.advance("job", 200):
            d.on_transition(t)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        provider.shutdown()
    records = [x.log_record for x in exporter.get_finished_logs()]
    states = [r.attributes["otel_gpu.breaker.state"] for r in records if r.attributes]
    assert states == ["open", "half_open", "closed"]
    first = records[0]
    assert first.severity_text in ("WARN", "WARNING")
    assert first.attributes is not None
    assert first.attributes["otel_gpu.alert.kind"] == STALL
    assert first.attributes["otel_gpu.breaker.episode"] == 1
    assert "no steps for 10 min" in str(first.body)
