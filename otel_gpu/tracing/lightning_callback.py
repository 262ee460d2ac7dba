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

import logging
import os
from collections.abc import Callable, Collection
from typing import Any

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_gpu.tracing import context, progress
from otel_gpu.tracing import control as stop_control
from otel_gpu.tracing.run import RunTracer, call_and_end, guarded, numeric_attributes
from otel_gpu.tracing.settings import TracingSettings
from otel_gpu.tracing.stop_record import record_stop

log = logging.getLogger("otel_gpu.tracing")

_state: dict[str, Any] = {"active": False, "hooked": False, "tracer_provider": None}
_classes: dict[str, type] = {}
_PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


class LightningInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """``opentelemetry_instrumentor`` entry point ``otel_gpu_lightning``."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        if not context.traces_enabled():
            return
        _state["active"] = True
        _state["tracer_provider"] = kwargs.get("tracer_provider")
        if not _state["hooked"]:
            _state["hooked"] = True
            for package in _PACKAGES.values():
                wrapt.register_post_import_hook(_patch_trainer, f"{package}.trainer.trainer")

    def _uninstrument(self, **kwargs: Any) -> None:
        _state["active"] = False


def lightning_callbacks() -> list[Any]:
    """Factory for ``lightning.pytorch.callbacks_factory``."""
    return _expecting([make_callback("lightning.pytorch")] if _state["active"] else [])


def pytorch_lightning_callbacks() -> list[Any]:
    """Factory for ``pytorch_lightning.callbacks_factory``."""
    return _expecting([make_callback("pytorch_lightning")] if _state["active"] else [])


def _expecting(callbacks: list[Any]) -> list[Any]:
    if callbacks:
        progress.expect_training()  # a Trainer is being built: loading until fit begins
    return callbacks


def make_callback(
    package: str = "lightning.pytorch", settings: TracingSettings | None = None
) -> Any:
    """A new callback for ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    cls = _classes.get(package)
    if cls is None:
        import importlib

        base = importlib.import_module(package).Callback
        cls = type("OtelGpuLightningCallback", (_CallbackMixin, base), {"__module__": __name__})
        _classes[package] = cls
    return cls(_state["tracer_provider"], settings)


def _patch_trainer(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, "Trainer.save_checkpoint", _save_checkpoint)


def _save_checkpoint(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    begun = _save_begin(instance, args[0] if args else kwargs.get("filepath"))
    if begun is None:
        return wrapped(*args, **kwargs)
    return call_and_end(wrapped, args, kwargs, lambda error: _save_end(begun, error))


@guarded
def _save_begin(trainer: Any, path: Any) -> Any:
    callbacks = getattr(trainer, "callbacks", ())
    cb = next((c for c in callbacks if isinstance(c, _CallbackMixin)), None)
    if cb is None or not cb._live():
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
        self.settings = settings or TracingSettings.load()
        self.run = RunTracer("lightning", tracer_provider, self.settings)
        self._owner_pid = os.getpid()
        self._stop_attached = False
        self._all_reduce: Any = None
        self._evaluate: Any = None

    def _live(self) -> bool:
        return os.getpid() == self._owner_pid

    @guarded
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._live():
            return
        self.run.train_begin(
            {
                "training.model": type(pl_module).__name__,
                "training.output_dir": str(trainer.default_root_dir),
                "training.max_steps": trainer.max_steps,
                "training.num_epochs": trainer.max_epochs,
            }
        )
        if self.settings.stop_enabled and not self._stop_attached:
            stop_control.attach()
            self._stop_attached = True
            self._all_reduce = stop_control.torch_all_reduce_max()

    def _finish(self, error: BaseException | None) -> None:
        self.run.train_end(error)
        if self._stop_attached:
            stop_control.detach()
            self._stop_attached = False

    @guarded
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self._finish(None)

    @guarded
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._live():
            self._finish(exception)

    @guarded
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self.run.epoch_begin(trainer.current_epoch)

    @guarded
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._live():
            self.run.epoch_end()

    @guarded
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step + 1
        if self._live() and not self.run.step_open(step):
            self.run.step_begin(step)

    @guarded
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self._live() or not self.run.step_open(step):
            return  # gradient accumulation: the optimizer step has not happened yet
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        values = dict(trainer.callback_metrics)
        if loss is not None:
            values["loss"] = loss.detach() if hasattr(loss, "detach") else loss
        self.run.step_values(step, values)
        self.run.step_end(step)
        if not self._stop_attached:
            return
        decision = stop_control.decide(
            step, self.settings.stop_sync_steps, self.run.rank.rank, self._all_reduce
        )
        if decision is None:
            return
        stop_control.consume()
        record_stop(self.run, decision, step)
        path = os.path.join(
            str(trainer.default_root_dir), "checkpoints", f"otel-gpu-stop-step={step}.ckpt"
        )
        trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
        trainer.should_stop = True

    @guarded
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._live() and self._evaluate is None:
            self._evaluate = self.run.phase_begin("evaluate")

    @guarded
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._live() and self._evaluate is not None:
            metrics = numeric_attributes(dict(trainer.callback_metrics))
            self.run.phase_end(self._evaluate, attributes=metrics)
            self._evaluate = None
