"""Zero-code instrumentation of HF ``transformers.Trainer`` and every subclass.

Post-import hooks, so a process that never imports transformers pays nothing:

- on ``transformers.trainer_callback``: wrap ``CallbackHandler.__init__`` to append one
  :class:`OtelGpuTrainerCallback`. Every Trainer builds its handler there, ms-swift's and TRL's
  included, and this survives ms-swift replacing ``DEFAULT_CALLBACKS`` (docs/background.md §5);
- on ``transformers.trainer``: wrap ``Trainer.train``, ``evaluate`` and ``_save_checkpoint``
  with ``*args, **kwargs`` wrappers (signature-agnostic across versions) that time those phases
  and end the spans in error when training raises (``on_train_end`` is skipped then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from otel_gpu.tracing import progress
from otel_gpu.tracing.lifecycle import FrameworkInstrumentor, Wrapper
from otel_gpu.tracing.run import call_and_end, guarded
from otel_gpu.tracing.settings import job_settings

log = logging.getLogger("otel_gpu.tracing")


class TransformersInstrumentor(FrameworkInstrumentor):
    """``opentelemetry_instrumentor`` entry point ``otel_gpu_transformers``.

    ``instrument(tracer_provider=..., settings=...)`` overrides the global tracer provider and
    the ``OTEL_GPU_*`` settings (tests, hand-configured SDKs).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("transformers >= 4.42",)

    def patches(self) -> Mapping[str, Mapping[str, Wrapper]]:
        return {
            "transformers.trainer_callback": {"CallbackHandler.__init__": self._handler_init},
            "transformers.trainer": {
                "Trainer.train": _train,
                "Trainer.evaluate": _phase_wrapper("evaluate"),
                "Trainer._save_checkpoint": _phase_wrapper("save_checkpoint"),
            },
        }

    def _handler_init(
        self, wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
    ) -> None:
        wrapped(*args, **kwargs)
        if _callback_of(instance) is not None:
            return
        progress.expect_training()  # a Trainer exists: loading until train() begins
        try:
            from otel_gpu.tracing.hf_callback import OtelGpuTrainerCallback

            settings = self.settings or job_settings()
            instance.callbacks.append(OtelGpuTrainerCallback(self.tracer_provider, settings))
        except Exception as exc:  # never break the Trainer
            log.warning("otel-gpu: Trainer callback not attached: %s", exc)


def _callback_of(handler: Any) -> Any:
    from otel_gpu.tracing.hf_callback import OtelGpuTrainerCallback

    for cb in getattr(handler, "callbacks", ()):
        if isinstance(cb, OtelGpuTrainerCallback):
            return cb
    return None


def _trainer_callback(trainer: Any) -> Any:
    handler = getattr(trainer, "callback_handler", None)
    cb = _callback_of(handler) if handler is not None else None
    return cb if cb is not None and cb.run.live() else None


def _train(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except BaseException as exc:
        _finish_run(instance, exc)
        raise


@guarded
def _finish_run(trainer: Any, error: BaseException) -> None:
    cb = _trainer_callback(trainer)
    if cb is not None:
        cb.run.train_end(error)


def _phase_wrapper(name: str) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        begun = _phase_begin(instance, name)
        if begun is None:  # not ours, a nested call, or it failed
            return wrapped(*args, **kwargs)
        return call_and_end(
            wrapped, args, kwargs, lambda error: _phase_end(instance, name, begun, error)
        )

    return wrapper


@guarded
def _phase_begin(trainer: Any, name: str) -> Any:
    cb = _trainer_callback(trainer)
    if cb is None or name in cb.wrapped_phases:
        return None
    phase = cb.run.phase_begin(name)
    cb.wrapped_phases.add(name)
    return cb, phase


@guarded
def _phase_end(trainer: Any, name: str, begun: Any, error: BaseException | None) -> None:
    cb, phase = begun
    cb.wrapped_phases.discard(name)
    attrs = {}
    if name == "save_checkpoint":
        from otel_gpu.tracing.hf_callback import checkpoint_path

        attrs["training.checkpoint.path"] = checkpoint_path(trainer.args, trainer.state)
        cb.saved_step = trainer.state.global_step
    cb.run.phase_end(phase, error, attrs)
