"""The HF ``transformers`` Trainer callback: spans, progress and checkpoint-and-stop.

Imported only once ``transformers.trainer_callback`` is (by the instrumentor's post-import
hook), or by users who add :class:`OtelGpuTrainerCallback` to ``Trainer(callbacks=[...])``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from opentelemetry.trace import TracerProvider
from transformers.trainer_callback import TrainerCallback

from otel_gpu.tracing.lifecycle import TrainingRun
from otel_gpu.tracing.run import guarded, numeric_attributes
from otel_gpu.tracing.settings import TracingSettings

log = logging.getLogger("otel_gpu.tracing")


def train_attributes(args: Any, state: Any, model: Any) -> dict[str, Any]:
    """The ``train`` span's attributes from TrainingArguments, TrainerState and the model."""
    attrs: dict[str, Any] = {
        "training.output_dir": getattr(args, "output_dir", None),
        "training.max_steps": getattr(state, "max_steps", None),
        "training.num_epochs": getattr(args, "num_train_epochs", None),
        "training.batch_size": getattr(args, "per_device_train_batch_size", None),
        "training.gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
    }
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if name:
        attrs["training.model"] = str(name)
    if config is not None and getattr(config, "model_type", None):
        attrs["training.model_type"] = str(config.model_type)
    tuner = getattr(args, "tuner_type", None) or getattr(args, "train_type", None)
    if not tuner and getattr(model, "peft_config", None):
        configs = model.peft_config.values() if isinstance(model.peft_config, dict) else []
        types = {str(getattr(c, "peft_type", "")).split(".")[-1].lower() for c in configs}
        tuner = ",".join(sorted(t for t in types if t)) or None
    if tuner:
        attrs["training.tuner_type"] = str(tuner)
    return {k: v for k, v in attrs.items() if isinstance(v, (str, int, float))}


class OtelGpuTrainerCallback(TrainerCallback):
    """Writes the run's spans and progress; carries out :func:`request_stop`.

    Attached to every Trainer automatically under ``opentelemetry-instrument``; add it by hand
    (``Trainer(..., callbacks=[OtelGpuTrainerCallback()])``) when configuring OTel yourself.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        settings: TracingSettings | None = None,
    ) -> None:
        self.run = TrainingRun("transformers", tracer_provider, settings)
        self.wrapped_phases: set[str] = set()  # phases the Trainer method wrappers time now
        self.saved_step: int | None = None  # the step whose save the wrapper already timed

    # -- lifecycle ---------------------------------------------------------------------------

    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.live():
            self.run.train_begin(train_attributes(args, state, kwargs.get("model")))

    @guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.live():
            self.run.train_end()  # when training raises, the ``Trainer.train`` wrapper ends it

    @guarded
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.live():
            self.run.epoch_begin(int(state.epoch or 0))

    @guarded
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.live():
            self.run.epoch_end()

    @guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.live():
            self.run.step_begin(state.global_step + 1)

    @guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.run.live():
            return
        self.run.step_end(state.global_step)
        if self.run.stop_agreed(state.global_step):
            control.should_save = True  # the Trainer writes the checkpoint in this same step
            control.should_training_stop = True

    @guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.run.live() and logs:
            self.run.step_values(state.global_step, logs)

    # -- evaluate and save (timed by the Trainer wrappers when present) -------------------------

    @guarded
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.live() and self.run.open_phase("evaluate") is None:
            self.run.phase_begin("evaluate")

    @guarded
    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        if not self.run.live():
            return
        phase = self.run.open_phase("evaluate")
        attrs = numeric_attributes(metrics or {})
        if phase is None:
            return
        if "evaluate" in self.wrapped_phases:
            phase.span.set_attributes(attrs)
        else:
            self.run.phase_end(phase, attributes=attrs)

    @guarded
    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        phase = self.run.open_phase("evaluate") if self.run.live() else None
        if phase is not None and "evaluate" not in self.wrapped_phases:
            self.run.phase_end(phase, attributes=numeric_attributes(metrics or {}))

    @guarded
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.run.live() or self.saved_step == state.global_step:
            return
        # No wrapper timed the save: record it as a point in time with its path.
        path = checkpoint_path(args, state)
        phase = self.run.phase_begin("save_checkpoint", {"training.checkpoint.path": path})
        self.run.phase_end(phase)


def checkpoint_path(args: Any, state: Any) -> str:
    """Where the Trainer writes the checkpoint of the current step."""
    path = getattr(state, "last_model_checkpoint", None)  # ms-swift records it
    if path and str(path).endswith(f"-{state.global_step}"):
        return str(path)
    return os.path.join(
        str(getattr(args, "output_dir", "") or ""), f"checkpoint-{state.global_step}"
    )
