"""A real HF Trainer (tiny random Llama, integer tokens, CPU) under the Trainer instrumentor."""

from __future__ import annotations

import threading

import pytest
import transformers  # noqa: F401  (a test dependency: fail, never skip)
from opentelemetry._logs import get_logger_provider, set_logger_provider
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support.tiny_training import TokenDataset, tiny_llama, training_args

from otel_gpu.tracing import control, progress
from otel_gpu.tracing.hf_instrumentor import TransformersInstrumentor
from otel_gpu.tracing.settings import TracingSettings

SPANS = InMemorySpanExporter()
READER = InMemoryMetricReader()
LOGS = InMemoryLogRecordExporter()

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def instrumented():
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(SPANS))
    meter_provider = MeterProvider(metric_readers=[READER])
    progress.register(meter_provider)
    import torch

    # This torch is a CPU build: no allocator instruments are created at all.
    assert progress.register_torch(torch, meter_provider) is False
    # Stop records go to the global logger provider, which another test may have set already.
    if not isinstance(get_logger_provider(), LoggerProvider):
        set_logger_provider(LoggerProvider())
    get_logger_provider().add_log_record_processor(SimpleLogRecordProcessor(LOGS))
    settings = TracingSettings(stop_enabled=True, stop_sync_steps=1)
    instrumentor = TransformersInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, settings=settings, skip_dep_check=True)
    yield
    instrumentor.uninstrument()


@pytest.fixture(autouse=True)
def clear():
    SPANS.clear()
    LOGS.clear()


def _trainer(tmp_path, dataset=None, callbacks=None, **args):
    from transformers import Trainer

    return Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path / "out", **args),
        train_dataset=dataset or TokenDataset(),
        eval_dataset=TokenDataset(n=8, seed=1),
        callbacks=callbacks,
    )


def _by_name(spans):
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def _metric_points(name):
    data = READER.get_metrics_data()
    points = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    points.extend(m.data.data_points)
    return points


def test_span_tree_and_attributes(tmp_path):
    phases_seen = []

    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                phases_seen.append(
                    {
                        p.attributes["training.phase"]: p.value
                        for p in _metric_points("training.phase")
                    }
                )

    trainer = _trainer(tmp_path, callbacks=[Probe()])
    trainer.train()

    spans = _by_name(SPANS.get_finished_spans())
    (train,) = spans["train"]
    (epoch,) = spans["epoch"]
    assert train.parent is None
    assert epoch.parent.span_id == train.context.span_id
    steps = sorted(spans["step"], key=lambda s: s.attributes["training.step"])
    assert [s.attributes["training.step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s.parent.span_id == epoch.context.span_id for s in steps)
    assert all(s.context.trace_id == train.context.trace_id for s in steps)
    # The numbers the trainer logged for each step, on that step; strings dropped.
    assert all(isinstance(s.attributes["training.loss"], float) for s in steps)
    assert "training.learning_rate" in steps[0].attributes
    assert "training.grad_norm" in steps[0].attributes
    # ... and as metrics (issue 19.2): the last step's numbers, a loss curve for any backend.
    (loss,) = _metric_points("training.loss")
    assert loss.value == steps[-1].attributes["training.loss"]
    (lr,) = _metric_points("training.learning_rate")
    assert lr.value == steps[-1].attributes["training.learning_rate"]
    assert _metric_points("training.grad_norm")[0].value > 0
    assert _metric_points("training.step.duration")[0].value > 0
    assert steps[0].end_time <= steps[1].start_time
    assert len(spans["evaluate"]) == 2
    assert all("training.eval_loss" in s.attributes for s in spans["evaluate"])
    saves = spans["save_checkpoint"]
    assert [s.attributes["training.checkpoint.path"] for s in saves] == [
        str(tmp_path / "out" / "checkpoint-3"),
        str(tmp_path / "out" / "checkpoint-6"),
    ]
    assert all(s.end_time > s.start_time for s in saves)  # timed by the _save_checkpoint wrapper
    for s in [train, epoch, *steps, *saves]:
        assert s.attributes["otel_gpu.job.rank"] == 0
        assert s.attributes["otel_gpu.job.world_size"] == 1
    assert train.attributes["training.output_dir"] == str(tmp_path / "out")
    assert train.attributes["training.model_type"] == "llama"
    assert train.attributes["training.max_steps"] == 6
    assert train.status.status_code is StatusCode.UNSET
    # Progress metrics: the phase while training, the last step after it.
    assert phases_seen == [{"load": 0, "train": 1, "evaluate": 0, "save": 0}]
    assert [p.value for p in _metric_points("training.step")] == [6]
    assert _metric_points("training.phase") == []  # no phase once training is over
    # CPU build of torch: no allocator instruments at all.
    assert not _metric_points("torch.cuda.memory.allocated")


def test_step_spans_every_nth(tmp_path):
    from otel_gpu.tracing.hf_callback import OtelGpuTrainerCallback

    trainer = _trainer(tmp_path, eval_strategy="no", save_strategy="no")
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, OtelGpuTrainerCallback)]
    assert len(ours) == 1  # attached once, by the CallbackHandler hook
    ours[0].run.settings = TracingSettings(step_spans_every=4)
    trainer.train()
    steps = [s for s in SPANS.get_finished_spans() if s.name == "step"]
    assert [s.attributes["training.step"] for s in steps] == [4]


def test_exception_ends_spans_in_error(tmp_path):
    # Row 13 of the data is bad: the fourth batch of 4 fails while loading.
    trainer = _trainer(tmp_path, dataset=TokenDataset(n=64, fail_at=13), max_steps=8)
    trainer.args.dataloader_drop_last = False
    with pytest.raises(ValueError, match="bad sample 13"):
        trainer.train()
    spans = _by_name(SPANS.get_finished_spans())
    (train,) = spans["train"]
    assert train.status.status_code is StatusCode.ERROR
    assert "bad sample 13" in train.status.description
    assert any(e.name == "exception" for e in train.events)
    assert spans["epoch"][0].status.status_code is StatusCode.ERROR
    assert progress.current_phase() is None  # the train phase is left, too


def test_requested_stop_checkpoints_at_that_step(tmp_path):
    from transformers import TrainerCallback

    answers = []

    class Detector(TrainerCallback):
        # Another component asks from its own thread while step 2 ends.
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                t = threading.Thread(
                    target=lambda: answers.append(control_request("loss diverged"))
                )
                t.start()
                t.join()

    def control_request(reason):
        return control.request_stop(reason)

    assert control.request_stop("nobody is training") is False
    trainer = _trainer(
        tmp_path, callbacks=[Detector()], max_steps=10, eval_strategy="no", save_steps=100
    )
    result = trainer.train()
    assert answers == [True]
    assert result.global_step == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-2"]
    spans = _by_name(SPANS.get_finished_spans())
    (train,) = spans["train"]
    (event,) = [e for e in spans["epoch"][0].events if e.name == "otel_gpu.stop"]
    assert event.attributes["otel_gpu.stop.reason"] == "loss diverged"
    assert event.attributes["training.step"] == 2
    assert train.status.status_code is StatusCode.UNSET
    (record,) = [r.log_record for r in LOGS.get_finished_logs()]
    assert "loss diverged" in record.body and "step 2" in record.body
    assert record.trace_id == train.context.trace_id
    # The run is over: a request now reaches no trainer (and is not kept for a later one).
    assert control.request_stop("after the run") is False


def test_a_failing_telemetry_plugin_never_breaks_training(tmp_path, caplog):
    from opentelemetry.sdk.trace import SpanProcessor

    from otel_gpu.tracing.hf_callback import OtelGpuTrainerCallback

    class Broken(SpanProcessor):
        def on_start(self, span, parent_context=None):
            raise RuntimeError("span processor bug")

    broken = TracerProvider()
    broken.add_span_processor(Broken())
    ours = OtelGpuTrainerCallback(tracer_provider=broken)
    trainer = _trainer(tmp_path, callbacks=[ours], eval_strategy="no", save_strategy="no")
    assert [
        c for c in trainer.callback_handler.callbacks if isinstance(c, OtelGpuTrainerCallback)
    ] == [ours]
    with caplog.at_level("WARNING", logger="otel_gpu.tracing"):
        result = trainer.train()
    assert result.global_step == 6
    assert "span processor bug" in caplog.text
