"""What every framework adapter shares: one training run's lifecycle and one instrumentor's.

:class:`TrainingRun` is the run as the HF Trainer callback, the Lightning callback and the
hand-written-loop API drive it: the span tree (:class:`~otel_gpu.tracing.run.RunTracer`), the
check that a hook runs in the process that built it (a forked DataLoader worker inherits the
callback objects), and the checkpoint-and-stop agreement taken at step ends.

:class:`FrameworkInstrumentor` is the ``opentelemetry_instrumentor`` side: post-import hooks
registered once, framework methods wrapped while instrumented and restored by
``uninstrument()``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.trace import TracerProvider

from otel_gpu.tracing import context
from otel_gpu.tracing import control as stop_control
from otel_gpu.tracing.run import RunTracer
from otel_gpu.tracing.settings import TracingSettings
from otel_gpu.tracing.stop_record import record_stop

# wrapt's wrapper signature: (wrapped, instance, args, kwargs) -> result
Wrapper = Callable[[Callable[..., Any], Any, Any, Any], Any]


class TrainingRun(RunTracer):
    """One training run in this process, with its stop agreement; see the module docstring."""

    def __init__(
        self,
        framework: str,
        tracer_provider: TracerProvider | None = None,
        settings: TracingSettings | None = None,
    ) -> None:
        super().__init__(framework, tracer_provider, settings)
        self._owner_pid = os.getpid()
        self._stop_attached = False
        self._all_reduce: Callable[[int], int] | None = None

    def live(self) -> bool:
        """True in the process that built this run (False in a forked child)."""
        return os.getpid() == self._owner_pid

    def train_begin(self, attributes: Mapping[str, Any]) -> None:
        """Open the ``train`` span; with ``OTEL_GPU_STOP`` on, :func:`request_stop` now
        reaches this run."""
        super().train_begin(attributes)
        if self.settings.stop_enabled and not self._stop_attached:
            stop_control.attach()
            self._stop_attached = True
            self._all_reduce = stop_control.torch_all_reduce_max()

    def train_end(self, error: BaseException | None = None) -> None:
        """Close the run's spans; a stop request it did not act on is forgotten."""
        super().train_end(error)
        if self._stop_attached:
            stop_control.detach()
            self._stop_attached = False

    def stop_agreed(self, step: int) -> bool:
        """Whether the ranks agreed, at the end of ``step``, to checkpoint and stop now.

        Every rank must call it at every step end (the agreement is a collective). True once
        per request, which is then recorded (span event, log record, stderr line).
        """
        if not self._stop_attached:
            return False
        decision = stop_control.decide(
            step, self.settings.stop_sync_steps, self.rank.rank, self._all_reduce
        )
        if decision is None:
            return False
        stop_control.consume()
        record_stop(self, decision, step)
        return True


class FrameworkInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Wraps a framework's methods once its modules are imported, while instrumented.

    Subclasses name the methods in :meth:`patches`. ``instrument(tracer_provider=...,
    settings=...)`` overrides the global tracer provider and the ``OTEL_GPU_*`` settings
    (tests, hand-configured SDKs). BaseInstrumentor makes each subclass a singleton, so the
    framework's hooks find this state on ``type()``: class attributes hold the defaults.
    """

    active = False  # instrumented (and traces enabled): hooks attach callbacks
    tracer_provider: TracerProvider | None = None
    settings: TracingSettings | None = None
    _hooked: frozenset[str] = frozenset()  # modules with a post-import hook (never removed)
    _patched: frozenset[str] = frozenset()  # modules whose methods are wrapped now

    def patches(self) -> Mapping[str, Mapping[str, Wrapper]]:
        """``{module: {"Class.method": wrapper}}``: what to wrap when ``module`` is imported."""
        raise NotImplementedError

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        if not context.traces_enabled():
            return
        self.tracer_provider = kwargs.get("tracer_provider")
        self.settings = kwargs.get("settings")
        self.active = True
        for module in self.patches():
            if module in self._hooked:
                if module in sys.modules:  # instrumented again after an uninstrument()
                    self._patch(sys.modules[module])
                continue
            self._hooked |= {module}
            wrapt.register_post_import_hook(self._patch, module)  # runs now if imported

    def _patch(self, module: Any) -> None:
        name = module.__name__
        if not self.active or name in self._patched:
            return
        self._patched |= {name}
        for target, wrapper in self.patches()[name].items():
            wrapt.wrap_function_wrapper(module, target, wrapper)

    def _uninstrument(self, **kwargs: Any) -> None:
        self.active = False
        for name in self._patched:
            module = sys.modules[name]
            for target in self.patches()[name]:
                owner, method = target.rsplit(".", 1)
                unwrap(getattr(module, owner), method)
        self._patched = frozenset()
