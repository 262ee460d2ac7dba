"""The public API for hand-written training loops: :func:`phase` and :func:`step`.

    with otel_gpu.phase("train"):
        for n, batch in enumerate(loader, 1):
            loss = train_step(batch)
            if otel_gpu.step(n, loss=loss.item()):   # True: a checkpoint-and-stop was requested
                save_checkpoint(); break
            if n % 100 == 0:
                with otel_gpu.phase("evaluate"):
                    evaluate()

Spans and metrics are the same as for the HF Trainer (see docs/tracing.md): ``phase("train")`` opens
the ``train`` span, other names open a child span of that name; ``load``, ``train``,
``evaluate`` and ``save`` / ``save_checkpoint`` also set ``training.phase``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from otel_gpu.tracing.lifecycle import TrainingRun
from otel_gpu.tracing.run import guarded
from otel_gpu.tracing.settings import TracingSettings


class _ManualLoop:
    """The process's hand-written training loop: its run and the last step boundary."""

    def __init__(self, settings: TracingSettings | None = None) -> None:
        self.run = TrainingRun("manual", settings=settings)
        self.last_step_ns: int | None = None  # a step span starts here (time.time_ns())

    @guarded
    def open(self, name: str, attributes: dict[str, Any]) -> tuple[Any, Any] | None:
        """(phase handle or None for ``train``, its span)."""
        self.last_step_ns = time.time_ns()
        if name != "train":
            handle = self.run.phase_begin(name, attributes)
            return handle, handle.span
        self.run.train_begin(attributes)
        return None, self.run.train_span

    @guarded
    def close(self, handle: Any, error: BaseException | None) -> None:
        if handle is None:
            self.run.train_end(error)
        else:
            self.run.phase_end(handle, error)
        self.last_step_ns = time.time_ns()

    @guarded
    def step(self, n: int, numbers: dict[str, Any]) -> bool:
        now = time.time_ns()
        self.run.step_done(n, self.last_step_ns or now, numbers)
        self.last_step_ns = now
        return self.run.stop_agreed(n)


_loop: _ManualLoop | None = None


def _current() -> _ManualLoop:
    global _loop
    if _loop is None:
        _loop = _ManualLoop()
    return _loop


@contextlib.contextmanager
def phase(name: str, **attributes: Any) -> Iterator[None]:
    """Time a phase of the job as a span named ``name`` (and ``training.phase`` when known).

    An exception leaving the block ends the span in error (and is re-raised). Spans you start
    inside the block become its children. Telemetry failures never reach your code.
    """
    loop = _current()
    opened = loop.open(name, attributes)
    span = opened[1] if opened else None
    token = otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        if token is not None:
            otel_context.detach(token)
        if opened:
            loop.close(opened[0], error)


def step(n: int, **numbers: Any) -> bool:
    """Mark the end of global step ``n`` with the numbers to record (loss=..., lr=...).

    Writes a ``step`` span from the previous call (or the phase start) until now, sets
    ``training.step``, and returns True when the ranks agreed to checkpoint and stop
    (``OTEL_GPU_STOP=true`` and :func:`~otel_gpu.tracing.control.request_stop` called): save
    your checkpoint and leave the loop. Under DDP every rank must call it at every step.
    """
    return bool(_current().step(int(n), numbers))


def _reset(settings: TracingSettings | None = None) -> None:
    """Forget the process's manual loop (tests)."""
    global _loop
    _loop = _ManualLoop(settings) if settings is not None else None
