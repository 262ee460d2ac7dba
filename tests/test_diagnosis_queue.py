"""Alerts wait (bounded) for their diagnosis, then reach the actions and the outputs with it
(otel_gpu/agent/diagnosis.py); the engine and breaker judge exactly as without it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_gpu.actions.notifiers import format_text
from otel_gpu.actions.span_event import add_alert_event
from otel_gpu.agent.diagnosis import DiagnosisQueue
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.detect.breaker import OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import LEAK, STALL, Alert, Diagnosis
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.outputs.summary import RunSummary, diagnosis_record
from otel_gpu.sampling.snapshot import GpuSample, Snapshot

pytestmark = pytest.mark.unit

GB = 1e9
FOUND = Diagnosis(
    "memory",
    (
        "model._cache: 1,204 tensors, 3.1 GiB, +410 MiB in 60 s",
        "losses (train.py:41): +12 MiB",
        "x",
        "y",
    ),
    {"holders": [{"path": "model._cache", "bytes": 3.3e9}]},
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _alert(subject: str = "gpu:A", kind: str = LEAK, t: float = 1.0) -> Alert:
    return Alert(kind, subject, t, "warning", "memory leak suspected")


def _opened(alert: Alert) -> Transition:
    return Transition(alert.subject, "closed", OPEN, alert.time, "alert", alert, 1)


def test_an_alert_waits_for_its_diagnosis_and_its_transitions_carry_it() -> None:
    gate = threading.Event()
    clock = Clock()

    def diagnose(alert: Alert) -> Diagnosis:
        gate.wait(10)
        return FOUND

    q = DiagnosisQueue({LEAK: diagnose}, timeout_s=30, clock=clock)
    alert = _alert()
    q.submit(alert, [_opened(alert)])
    later = Transition("gpu:A", OPEN, "half_open", 9.0, "cooled down", None, 1)
    other = Transition("gpu:B", "closed", OPEN, 2.0, "other", None, 1)
    assert q.hold(later) and not q.hold(other)  # only its own subject waits behind it
    assert q.release() == []
    gate.set()
    deadline = time.monotonic() + 10
    out: list = []
    while not out and time.monotonic() < deadline:
        out = q.release()
        time.sleep(0.01)
    [(released, transitions)] = out
    assert released.diagnosis is not None and released.diagnosis.lines[0].startswith("model._cache")
    assert released.diagnosis.took_s is not None
    assert [t.to_state for t in transitions] == [OPEN, "half_open"]
    assert transitions[0].alert is released and transitions[1].alert is None
    q.close()


def test_order_is_kept_and_a_slow_diagnosis_times_out_with_the_reason() -> None:
    clock = Clock()
    never = threading.Event()
    q = DiagnosisQueue(
        {LEAK: lambda a: (never.wait(5), FOUND)[1], STALL: lambda a: FOUND},
        timeout_s=15,
        clock=clock,
    )
    first, second = _alert("gpu:A", LEAK), _alert("gpu:B", STALL, t=2.0)
    q.submit(first, [])
    q.submit(second, [])
    time.sleep(0.2)  # the second is done, the first is not: nothing may overtake
    assert q.release() == []
    clock.now = 16.0
    out = q.release()
    assert [a.subject for a, _ in out] == ["gpu:A", "gpu:B"]
    assert out[0][0].diagnosis.error == "diagnosis took over 15 s"  # type: ignore[union-attr]
    assert out[0][0].diagnosis.shown() == ["no diagnosis: diagnosis took over 15 s"]  # type: ignore[union-attr]
    assert out[1][0].diagnosis.lines == FOUND.lines  # type: ignore[union-attr]
    never.set()
    q.close()


@pytest.mark.parametrize(
    ("diagnose", "error"),
    [(lambda a: None, "nothing found"), (lambda a: 1 / 0, "diagnosis failed: division by zero")],
    ids=["nothing", "raises"],
)
def test_a_diagnoser_that_finds_nothing_or_breaks_is_said_so(diagnose, error: str) -> None:  # type: ignore[no-untyped-def]
    q = DiagnosisQueue({LEAK: diagnose}, clock=Clock())
    q.submit(_alert(), [])
    time.sleep(0.2)
    [(alert, _)] = q.release()
    assert alert.diagnosis is not None and alert.diagnosis.error == error
    q.close()


def test_force_releases_everything_held_at_close() -> None:
    never = threading.Event()
    q = DiagnosisQueue({LEAK: lambda a: (never.wait(5), FOUND)[1]}, clock=Clock())
    q.submit(_alert(), [])
    [(alert, _)] = q.release(force=True)
    assert alert.diagnosis is not None and "took over" in (alert.diagnosis.error or "")
    never.set()
    q.close()


def _leak_snapshots() -> Iterator[Snapshot]:
    used, t = 20 * GB, 0.0
    while t <= 6 * 3600:
        if t > 3600:
            used += 3e9 / 3600 * 60  # 3 GB/h
        gpu = GpuSample(
            uuid="GPU-live", index=0, memory_used=int(used), memory_total=int(80 * GB),
            util_gpu=0.9, power_w=600.0, power_limit_w=700.0, processes_listed=False,
        )  # fmt: skip
        yield Snapshot(time=t, gpus=(gpu,))
        t += 60.0


def _run(watchdog: Watchdog) -> tuple[list[Alert], list[Transition]]:
    alerts: list[Alert] = []
    transitions: list[Transition] = []
    watchdog.alert_listeners.append(alerts.append)
    watchdog.transition_listeners.append(transitions.append)
    for snap in _leak_snapshots():
        watchdog.on_snapshot(snap)
        time.sleep(0.0005 if watchdog.diagnosis is not None and not alerts else 0)
    watchdog.close(2.0)
    return alerts, transitions


def test_the_watchdog_attaches_the_diagnosis_and_judges_exactly_as_without() -> None:
    cfg = DetectConfig(leak_bucket_s=60, leak_min_window_s=1800, leak_context_s=3600)
    plain_alerts, plain = _run(Watchdog(Engine(cfg), Breaker(BreakerConfig())))
    assert plain and plain[0].to_state == OPEN and plain[0].alert is not None

    seen: list[str] = []
    diagnosed = Watchdog(Engine(cfg), Breaker(BreakerConfig()))
    diagnosed.diagnosis = DiagnosisQueue({LEAK: lambda a: (seen.append(a.subject), FOUND)[1]})
    alerts, transitions = _run(diagnosed)

    assert seen == ["gpu:GPU-live"]
    # same alerts and transitions at the same data times (the breaker judged as always)
    assert [(a.kind, a.time) for a in alerts] == [(a.kind, a.time) for a in plain_alerts]
    assert [(t.to_state, t.time) for t in transitions] == [(t.to_state, t.time) for t in plain]
    opened = transitions[0]
    assert opened.alert is not None and opened.alert.diagnosis is not None
    assert opened.alert.diagnosis.lines == FOUND.lines and alerts[0] is opened.alert

    # every output a person reads carries it
    title, body = format_text(opened)
    assert body.splitlines()[2:5] == list(FOUND.lines[:3]) and "y" not in body.splitlines()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("train") as span:
        assert add_alert_event(opened.alert, span)
    [event] = exporter.get_finished_spans()[0].events
    assert event.attributes is not None
    assert tuple(event.attributes["otel_gpu.alert.diagnosis"]) == FOUND.lines
    assert event.attributes["otel_gpu.alert.diagnosis.kind"] == "memory"
    record = diagnosis_record(opened.alert)
    assert record is not None and record["data"]["holders"][0]["path"] == "model._cache"
    summary = RunSummary()
    summary.on_alert(opened.alert)
    assert summary.to_dict()["alerts"][0]["diagnosis"]["lines"][0] == FOUND.lines[0]


def test_secrets_in_a_diagnosis_are_masked_where_it_leaves_the_machine() -> None:
    leaky = Diagnosis(
        "memory",
        ("cache of --hf_token hf_abcdefghijklmnopqrstuvwxyz123456",),
        {"site": "token=ghp_0123456789abcdefghijklmnopqrstuvwxyz"},
    )
    alert = Alert(LEAK, "gpu:A", 1.0, "warning", "leak", diagnosis=leaky)
    _, body = format_text(_opened(alert))
    record = diagnosis_record(alert)
    assert "hf_abcdefghijklmnopqrstuvwxyz123456" not in body
    assert "ghp_0123456789abcdefghijklmnopqrstuvwxyz" not in str(record)
