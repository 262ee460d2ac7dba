"""The public API for hand-written training loops: :func:`phase` and :func:`step`.

    with otel_gpu.phase("train"):
        for n, batch in enumerate(loader, 1):
            loss = train_step(batch)
            if otel_gpu.step(n, loss=loss.item()):   # True: a checkpoint-and-stop was requested
                save_checkpoint(); break
            if n % 100 == 0:
                with otel_gpu.phase("evaluate"):
                    evaluate()

Spans and metrics are the same as for the HF Trainer (see README): ``phase("train")`` opens
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

from otel_gpu.tracing import control as stop_control
from otel_gpu.tracing.run import RunTracer, guarded
from otel_gpu.tracing.settings import TracingSettings
from otel_gpu.tracing.stop_record import record_stop

_run: RunTracer | None = None
_last_step_ns: int | None = None
_stop_attached = False
_all_reduce: Any = None


def _tracer() -> RunTracer:
    global _run
    if _run is None:
        _run = RunTracer("manual")
    return _run


@contextlib.contextmanager
def phase(name: str, **attributes: Any) -> Iterator[None]:
    """Time a phase of the job as a span named ``name`` (and ``training.phase`` when known).

    An exception leaving the block ends the span in error (and is re-raised). Spans you start
    inside the block become its children. Telemetry failures never reach your code.
    """
    opened = _open(name, attributes)
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
            _close(opened[0], error)


@guarded
def _open(name: str, attributes: dict[str, Any]) -> tuple[Any, Any] | None:
    """(phase handle or None for ``train``, its span)."""
    global _last_step_ns, _stop_attached, _all_reduce
    run = _tracer()
    _last_step_ns = time.time_ns()
    if name != "train":
        handle = run.phase_begin(name, attributes)
        return handle, handle.span
    run.train_begin(attributes)
    if run.settings.stop_enabled and not _stop_attached:
        stop_control.attach()
        _stop_attached, _all_reduce = True, stop_control.torch_all_reduce_max()
    return None, run.train_span


@guarded
def _close(handle: Any, error: BaseException | None) -> None:
    global _last_step_ns, _stop_attached
    run = _tracer()
    if handle is None:
        run.train_end(error)
        if _stop_attached:
            stop_control.detach()
            _stop_attached = False
    else:
        run.phase_end(handle, error)
    _last_step_ns = time.time_ns()


def step(n: int, **numbers: Any) -> bool:
    """Mark the end of global step ``n`` with the numbers to record (loss=..., lr=...).

    Writes a ``step`` span from the previous call (or the phase start) until now, sets
    ``training.step``, and returns True when the ranks agreed to checkpoint and stop
    (``OTEL_GPU_STOP=true`` and :func:`~otel_gpu.tracing.control.request_stop` called): save
    your checkpoint and leave the loop. Under DDP every rank must call it at every step.
    """
    return bool(_step(int(n), numbers))


@guarded
def _step(n: int, numbers: dict[str, Any]) -> bool:
    global _last_step_ns
    run = _tracer()
    now = time.time_ns()
    run.step_done(n, _last_step_ns or now, numbers)
    _last_step_ns = now
    if not _stop_attached:
        return False
    decision = stop_control.decide(n, run.settings.stop_sync_steps, run.rank.rank, _all_reduce)
    if decision is None:
        return False
    stop_control.consume()
    record_stop(run, decision, n)
    return True


def _reset(settings: TracingSettings | None = None) -> None:
    """Forget the process's manual run (tests)."""
    global _run, _last_step_ns
    _run = RunTracer("manual", settings=settings) if settings is not None else None
    _last_step_ns = None
