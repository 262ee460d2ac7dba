"""The public API for hand-written loops: ``phase`` and ``step`` (in-process, in-memory SDK)."""

from __future__ import annotations

import threading

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from otel_gpu.tracing import api, control, phase, progress, request_stop, step
from otel_gpu.tracing.run import numeric_attributes
from otel_gpu.tracing.settings import TracingSettings

pytestmark = pytest.mark.unit

SPANS = InMemorySpanExporter()


_attached: list[object] = []


@pytest.fixture(autouse=True)
def provider():
    # The API uses the global provider, which another test module may have set already.
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    tp = trace.get_tracer_provider()
    if tp not in _attached:
        tp.add_span_processor(SimpleSpanProcessor(SPANS))
        _attached.append(tp)
    SPANS.clear()
    api._reset(TracingSettings(stop_enabled=True, stop_sync_steps=1))
    yield
    api._reset()


def test_hand_written_loop():
    tracer = trace.get_tracer("user")
    with phase("train", **{"training.model": "mine"}):
        assert progress.current_phase() == "train"
        for n in range(1, 4):
            assert step(n, loss=1.0 / n, note="text is dropped") is False
        with phase("evaluate"):
            assert progress.current_phase() == "evaluate"
            with tracer.start_as_current_span("user.work"):
                pass
    assert progress.current_phase() is None
    assert progress.current_step() == 3
    spans = {s.name: s for s in SPANS.get_finished_spans()}
    train = spans["train"]
    assert train.attributes["training.model"] == "mine"
    assert train.attributes["training.framework"] == "manual"
    steps = [s for s in SPANS.get_finished_spans() if s.name == "step"]
    assert [s.attributes["training.step"] for s in steps] == [1, 2, 3]
    assert steps[1].attributes["training.loss"] == 0.5
    assert "training.note" not in steps[1].attributes
    assert all(s.parent.span_id == train.context.span_id for s in steps)
    assert spans["evaluate"].parent.span_id == train.context.span_id
    assert spans["user.work"].parent.span_id == spans["evaluate"].context.span_id


def test_exception_in_a_phase():
    with pytest.raises(RuntimeError), phase("train"), phase("save_checkpoint", path="/ckpt"):
        raise RuntimeError("disk full")
    spans = {s.name: s for s in SPANS.get_finished_spans()}
    assert spans["save_checkpoint"].status.status_code is StatusCode.ERROR
    assert spans["train"].status.status_code is StatusCode.ERROR
    assert "disk full" in spans["train"].status.description


def test_step_reports_an_agreed_stop():
    assert request_stop("too early") is False  # nobody trains yet
    with phase("train"):
        assert step(1) is False
        t = threading.Thread(target=lambda: request_stop("memory leak"))
        t.start()
        t.join()
        assert step(2) is True
        assert step(3) is False  # the request was acted on once, not again
    (train,) = [s for s in SPANS.get_finished_spans() if s.name == "train"]
    (event,) = train.events
    assert event.name == "otel_gpu.stop"
    assert event.attributes["otel_gpu.stop.reason"] == "memory leak"


@pytest.mark.parametrize(
    ("logs", "expected"),
    [
        ({"loss": 1.5, "epoch": 2}, {"training.loss": 1.5, "training.epoch": 2}),
        (
            {"memory(GiB)": 3.2, "train_speed(iter/s)": 7.0},
            {"training.memory_gib": 3.2, "training.train_speed_iter_s": 7.0},
        ),
        ({"global_step/max_steps": "5/10", "flag": True, "nan": float("nan")}, {}),
    ],
)
def test_numeric_attributes(logs, expected):
    assert numeric_attributes(logs) == expected


def test_decide_every_k_steps_uses_one_collective_and_names_the_requester():
    votes = []

    def all_reduce(vote):
        votes.append(vote)
        return 2  # rank 1 asked (vote = rank + 1)

    assert control.decide(3, 5, rank=0, all_reduce_max=all_reduce) is None
    assert votes == []  # not a sync step: no collective
    decision = control.decide(5, 5, rank=0, all_reduce_max=all_reduce)
    assert votes == [0]
    assert decision == control.StopDecision("stop requested on rank 1", 1)


def test_step_numbers_become_training_metrics() -> None:
    # The numbers of otel_gpu.step() as metrics (issue 19.2), read by the SDK's in-memory
    # reader: loss, learning rate, grad norm, seconds per step, samples and tokens per second.
    import time

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    assert progress.register(MeterProvider(metric_readers=[reader]))
    with phase("train"):
        for n in range(1, 4):
            time.sleep(0.02)
            step(n, loss=2.0 / n, lr=1e-3, grad_norm=0.5, samples=32, tokens=512)
    got = {
        m.name: m.data.data_points[0].value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.data.data_points
    }
    assert got["training.loss"] == pytest.approx(2.0 / 3)
    assert got["training.learning_rate"] == 1e-3
    assert got["training.grad_norm"] == 0.5
    assert 0.015 < got["training.step.duration"] < 1.0
    assert got["training.samples.rate"] == pytest.approx(32 / got["training.step.duration"])
    assert got["training.tokens.rate"] == pytest.approx(512 / got["training.step.duration"])
