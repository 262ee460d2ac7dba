"""The span tree of one training run, fed by framework callbacks or the public API.

``train`` ▸ ``load`` / ``epoch`` ▸ ``step``, and ``evaluate`` / ``save_checkpoint`` under the
current epoch (or ``train``). Step spans are written when the step is over, with the start and
end times recorded at its boundaries, so the numbers the trainer logs right after a step
(loss, learning rate, grad norm) land on that step's span.

The methods are called from the training thread only; they never raise into the job.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider

from otel_gpu.tracing import context, progress
from otel_gpu.tracing.settings import TracingSettings, job_settings

log = logging.getLogger("otel_gpu.tracing")

_root_taken = False  # the preset ``train`` root ids are used by one span per process


def numeric_attributes(values: Mapping[str, Any], prefix: str = "training.") -> dict[str, float]:
    """Finite numbers only, keys made attribute-safe: ``train_speed(iter/s)`` -> ``train_speed_iter_s``.

    Strings (ms-swift logs ``global_step/max_steps`` as text), bools and NaN are dropped.
    """
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            item = getattr(value, "item", None)  # a 0-d tensor or numpy scalar
            if item is None or getattr(value, "ndim", 0) != 0:
                continue
            device = getattr(value, "device", None)
            if device is not None and getattr(device, "type", "cpu") != "cpu":
                continue  # .item() on a GPU tensor would stall the job's stream
            try:
                value = item()
            except Exception:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        name = re.sub(r"[^a-z0-9_.]+", "_", str(key).lower()).strip("_")
        if name:
            out[prefix + name] = value
    return out


@dataclass
class _Phase:
    name: str
    span: Span
    metric_phase: str | None
    attributes: dict[str, Any] = field(default_factory=dict)


class RunTracer:
    """Spans and progress of one training run in this process."""

    def __init__(
        self,
        framework: str,
        tracer_provider: TracerProvider | None = None,
        settings: TracingSettings | None = None,
        rank: context.RankInfo | None = None,
    ) -> None:
        from otel_gpu import __version__

        self.framework = framework
        self.settings = settings or job_settings()
        self.rank = rank or context.RankInfo.from_env()
        self._provider = tracer_provider or trace.get_tracer_provider()
        if context.turned_off():  # a bad OTEL_GPU_* value: no telemetry, and no exception
            self._provider = trace.NoOpTracerProvider()
        self._tracer = trace.get_tracer(
            "otel_gpu.tracing", __version__, tracer_provider=self._provider
        )
        self._common = self.rank.attributes()
        self.train_span: Span | None = None
        self._train_phase: str | None = None
        self._epoch: Span | None = None
        self._phases: list[_Phase] = []
        self._step_n: int | None = None
        self._step_start: int | None = None
        self._step_end: int | None = None
        self._step_attrs: dict[str, Any] = {}

    # -- parents -------------------------------------------------------------------------------

    def _parent(self) -> Any:
        span = self._phases[-1].span if self._phases else self._epoch or self.train_span
        if span is not None:
            return trace.set_span_in_context(span)
        return context.run_root_context()

    def _start(
        self, name: str, attributes: Mapping[str, Any], start_time: int | None = None
    ) -> Span:
        attrs = {**self._common, **{k: v for k, v in attributes.items() if v is not None}}
        return self._tracer.start_span(
            name, context=self._parent(), attributes=attrs, start_time=start_time
        )

    # -- train -------------------------------------------------------------------------------

    @property
    def training(self) -> bool:
        return self.train_span is not None

    def train_begin(self, attributes: Mapping[str, Any]) -> None:
        """Open the run's ``train`` span (the trace root on global rank 0) and the train phase."""
        global _root_taken
        if self.train_span is not None:
            return
        load_started = progress.take_load_started()
        attrs: dict[str, Any] = {**self._common, "training.framework": self.framework}
        attrs.update({k: v for k, v in attributes.items() if v is not None})
        from otel_gpu.tracing import ids  # the SDK: only once a run starts

        # Rank 0's ``train`` is the root (under an outer TRACEPARENT, if any) and takes the ids
        # the launcher handed out; other ranks' ``train`` spans hang under it.
        parent = context.outer_context() if self.rank.rank == 0 else context.run_root_context()
        preset: Any = contextlib.nullcontext()
        generator = getattr(self._provider, "id_generator", None)
        root = context.parse_traceparent(_env_root())
        if (
            self.rank.rank == 0
            and not _root_taken
            and root is not None
            and isinstance(generator, ids.PresetIdGenerator)
        ):
            _root_taken = True
            preset = generator.preset(root.trace_id, root.span_id)
        with preset:
            self.train_span = self._tracer.start_span(
                "train", context=parent, attributes=attrs, start_time=load_started
            )
        if load_started is not None:
            self._tracer.start_span(
                "load",
                context=trace.set_span_in_context(self.train_span),
                attributes=self._common,
                start_time=load_started,
            ).end()
        self._train_phase = progress.push_phase("train")
        _set_job_span(self.train_span)

    def train_end(self, error: BaseException | None = None) -> None:
        """Close everything still open; with ``error``, each open span ends in error."""
        if self.train_span is None:
            return
        self._flush_step(error)
        while self._phases:
            self.phase_end(self._phases[-1], error)
        self.epoch_end(error)
        _finish(self.train_span, error)
        _set_job_span(None)
        self.train_span = None
        progress.pop_phase(self._train_phase)

    # -- epochs and steps --------------------------------------------------------------------

    def epoch_begin(self, epoch: int) -> None:
        self._flush_step()
        self.epoch_end()
        self._epoch = self._start("epoch", {"training.epoch": epoch})

    def epoch_end(self, error: BaseException | None = None) -> None:
        self._flush_step(error)
        if self._epoch is not None:
            _finish(self._epoch, error)
            self._epoch = None

    def step_begin(self, step: int) -> None:
        """Step ``step`` (1-based global optimizer step) starts now."""
        self._flush_step()
        self._step_n, self._step_start, self._step_end = step, time.time_ns(), None
        self._step_attrs = {}

    def step_open(self, step: int) -> bool:
        """True while step ``step`` has begun and not ended."""
        return self._step_n == step and self._step_end is None

    def step_end(self, step: int) -> None:
        """Step ``step`` is done; its span is written at the next boundary."""
        progress.set_step(step)
        if self._step_n == step and self._step_end is None:
            self._step_end = time.time_ns()

    def step_done(self, step: int, start_ns: int, values: Mapping[str, Any]) -> None:
        """Step ``step`` ran from ``start_ns`` until now (hand-written loops)."""
        self.step_begin(step)
        self._step_start = start_ns
        self.step_values(step, values)
        self.step_end(step)
        self._flush_step()

    def step_values(self, step: int, values: Mapping[str, Any]) -> None:
        """Numbers logged for ``step`` (strings are ignored); the training numbers among them
        become metrics (``training.loss``, ...) whatever the step."""
        progress.set_numbers(numeric_attributes(values, prefix=""))
        if self._step_n == step:
            self._step_attrs.update(numeric_attributes(values))

    def _flush_step(self, error: BaseException | None = None) -> None:
        n, start = self._step_n, self._step_start
        self._step_n = self._step_start = None
        if n is None or start is None:
            return
        every = self.settings.step_spans_every
        failed = error is not None and self._step_end is None
        if not failed and (every <= 0 or n % every != 0):
            return
        attrs = {"training.step": n, **self._step_attrs}
        span = self._start("step", attrs, start_time=start)
        _finish(span, error if failed else None, end_time=self._step_end)

    # -- phases (evaluate, save_checkpoint, user phases) -------------------------------------

    def phase_begin(self, name: str, attributes: Mapping[str, Any] | None = None) -> _Phase:
        self._flush_step()
        span = self._start(name, attributes or {})
        phase = _Phase(name, span, progress.push_phase(name))
        self._phases.append(phase)
        return phase

    def open_phase(self, name: str) -> _Phase | None:
        for phase in reversed(self._phases):
            if phase.name == name:
                return phase
        return None

    def phase_end(
        self,
        phase: _Phase,
        error: BaseException | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        if phase not in self._phases:
            return
        self._phases.remove(phase)
        if attributes:
            phase.span.set_attributes(dict(attributes))
        _finish(phase.span, error)
        progress.pop_phase(phase.metric_phase)

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        """An event on the innermost open span (the train span at step boundaries)."""
        span = self._phases[-1].span if self._phases else self._epoch or self.train_span
        if span is not None:
            span.add_event(name, dict(attributes))


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Framework hooks never raise into the job: log the first failure of each hook, go on."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if fn.__qualname__ not in _failed:
                _failed.add(fn.__qualname__)
                log.warning("otel-gpu: %s failed, skipped: %r", fn.__qualname__, exc)
            return None

    return wrapper


_failed: set[str] = set()


def call_and_end(
    wrapped: Callable[..., Any],
    args: Any,
    kwargs: Any,
    end: Callable[[BaseException | None], None],
) -> Any:
    """``wrapped(*args, **kwargs)``, then ``end(error)`` with what it raised (None if nothing),
    which is re-raised: the wrap of a framework method whose span must end either way."""
    error: BaseException | None = None
    try:
        return wrapped(*args, **kwargs)
    except BaseException as exc:
        error = exc
        raise
    finally:
        end(error)


def _set_job_span(span: Span | None) -> None:
    """Let the agent's alert actions add their events to this run's ``train`` span."""
    from otel_gpu.actions.span_event import set_job_span  # only once a run starts (launchers)

    set_job_span(span)


def _env_root() -> str | None:
    import os

    from otel_gpu.tracing.environment_variables import OTEL_GPU_TRAIN_TRACEPARENT

    return os.environ.get(OTEL_GPU_TRAIN_TRACEPARENT)


def _finish(span: Span, error: BaseException | None, end_time: int | None = None) -> None:
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=end_time)
