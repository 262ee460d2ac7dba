"""PyTorch Lightning: a callback attached by the ``callbacks_factory`` entry point groups.

Lightning calls every factory registered under ``lightning.pytorch.callbacks_factory`` (or
``pytorch_lightning.callbacks_factory`` for the old package name) when a Trainer is built.
Ours returns the callback only while :class:`LightningInstrumentor` is instrumented (it is under
``opentelemetry-instrument`` unless ``otel_gpu_lightning`` is in
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``), so a plain ``pip install`` changes nothing.
Configuring OTel yourself? Pass ``otel_gpu.tracing.lightning_callback.make_callback()`` in
``Trainer(callbacks=[...])``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from otel_gpu.tracing import progress
from otel_gpu.tracing.lifecycle import FrameworkInstrumentor, TrainingRun, Wrapper
from otel_gpu.tracing.run import call_and_end, guarded, numeric_attributes
from otel_gpu.tracing.settings import TracingSettings

log = logging.getLogger("otel_gpu.tracing")

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class LightningInstrumentor(FrameworkInstrumentor):
    """``opentelemetry_instrumentor`` entry point ``otel_gpu_lightning``."""

    def patches(self) -> Mapping[str, Mapping[str, Wrapper]]:
        return {
            f"{package}.trainer.trainer": {"Trainer.save_checkpoint": _save_checkpoint}
            for package in _PACKAGES
        }


def lightning_callbacks() -> list[Any]:
    """Factory for ``lightning.pytorch.callbacks_factory``."""
    return _while_instrumented("lightning.pytorch")


def pytorch_lightning_callbacks() -> list[Any]:
    """Factory for ``pytorch_lightning.callbacks_factory``."""
    return _while_instrumented("pytorch_lightning")


def _while_instrumented(package: str) -> list[Any]:
    if not LightningInstrumentor().active:
        return []
    progress.expect_training()  # a Trainer is being built: loading until fit begins
    return [make_callback(package)]


def make_callback(
    package: str = "lightning.pytorch", settings: TracingSettings | None = None
) -> Any:
    """A new callback for ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    instrumentor = LightningInstrumentor()
    return _callback_class(package)(instrumentor.tracer_provider, settings or instrumentor.settings)


@functools.cache
def _callback_class(package: str) -> type:
    base = importlib.import_module(package).Callback
    return type("OtelGpuLightningCallback", (_CallbackMixin, base), {"__module__": __name__})


def _save_checkpoint(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    begun = _save_begin(instance, args[0] if args else kwargs.get("filepath"))
    if begun is None:
        return wrapped(*args, **kwargs)
    return call_and_end(wrapped, args, kwargs, lambda error: _save_end(begun, error))


@guarded
def _save_begin(trainer: Any, path: Any) -> Any:
    callbacks = getattr(trainer, "callbacks", ())
    cb = next((c for c in callbacks if isinstance(c, _CallbackMixin)), None)
    if cb is None or not cb.run.live():
        return None
    return cb, cb.run.phase_begin("save_checkpoint", {"training.checkpoint.path": str(path)})


@guarded
def _save_end(begun: Any, error: BaseException | None) -> None:
    cb, phase = begun
    cb.run.phase_end(phase, error)


class _CallbackMixin:
    """The hooks; combined with the installed package's ``Callback`` by :func:`make_callback`."""

    def __init__(
        self, tracer_provider: Any = None, settings: TracingSettings | None = None
    ) -> None:
        super().__init__()
        self.run = TrainingRun("lightning", tracer_provider, settings)
        self._evaluate: Any = None

    @guarded
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.run.live():
            return
        self.run.train_begin(
            {
                "training.model": type(pl_module).__name__,
                "training.output_dir": str(trainer.default_root_dir),
                "training.max_steps": trainer.max_steps,
                "training.num_epochs": trainer.max_epochs,
            }
        )

    @guarded
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run.live():
            self.run.train_end()

    @guarded
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.run.live():
            self.run.train_end(exception)

    @guarded
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run.live():
            self.run.epoch_begin(trainer.current_epoch)

    @guarded
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run.live():
            self.run.epoch_end()

    @guarded
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step + 1
        if self.run.live() and not self.run.step_open(step):
            self.run.step_begin(step)

    @guarded
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self.run.live() or not self.run.step_open(step):
            return  # gradient accumulation: the optimizer step has not happened yet
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        values = dict(trainer.callback_metrics)
        if loss is not None:
            values["loss"] = loss.detach() if hasattr(loss, "detach") else loss
        self.run.step_values(step, values)
        self.run.step_end(step)
        if not self.run.stop_agreed(step):
            return
        path = os.path.join(
            str(trainer.default_root_dir), "checkpoints", f"otel-gpu-stop-step={step}.ckpt"
        )
        trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
        trainer.should_stop = True

    @guarded
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run.live() and self._evaluate is None:
            self._evaluate = self.run.phase_begin("evaluate")

    @guarded
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run.live() and self._evaluate is not None:
            metrics = numeric_attributes(dict(trainer.callback_metrics))
            self.run.phase_end(self._evaluate, attributes=metrics)
            self._evaluate = None
