"""Tracing settings: ``OTEL_GPU_*`` environment > default, declared once, validated once.

A bad value raises :class:`~otel_gpu.core.errors.UsageError` naming the variable and what it accepts;
inside the job (:func:`job_settings`) it turns telemetry off instead, with one line, and never
reaches the user's code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import Setting, boolean, choice, number, resolve
from otel_gpu.tracing import context
from otel_gpu.tracing.environment_variables import (
    OTEL_GPU_COLLECTIVE_TIMING,
    OTEL_GPU_ROLE,
    OTEL_GPU_STEP_SPANS_EVERY,
    OTEL_GPU_STOP,
    OTEL_GPU_STOP_SYNC_STEPS,
)

ROLES = ("auto", "launcher", "trainer", "node", "off")

DECLARED = (
    Setting(
        "role", OTEL_GPU_ROLE, choice(ROLES),
        "`auto`, `launcher`, `trainer`, `node` or `off` (see \"Which process does what\")",
        "`auto`",
    ),
    Setting(
        "step_spans_every", OTEL_GPU_STEP_SPANS_EVERY,
        number(0, integer=True, accepted="use 0 or more"),
        "a `step` span for every Nth step; `0` = no step spans (`training.step` still updates)",
        "`1`",
    ),
    Setting(
        "stop_enabled", OTEL_GPU_STOP, boolean,
        "let `request_stop` checkpoint and stop the trainer", "`false`",
    ),
    Setting(
        "stop_sync_steps", OTEL_GPU_STOP_SYNC_STEPS,
        number(1, integer=True, accepted="use 1 or more"),
        "under DDP, ranks agree on a stop every this many steps (one all-reduce of one integer)",
        "`10`",
    ),
    Setting(
        "collective_timing", OTEL_GPU_COLLECTIVE_TIMING, boolean,
        "time the blocking `torch.distributed` collectives on the CPU "
        "(`training.step.collective_wait`, `training.step.work`: the straggler alert's input); "
        "`false` leaves `torch.distributed` untouched",
        "`true`",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class TracingSettings:
    """The tracing side's settings; :data:`DECLARED` documents each field."""

    role: str = "auto"
    step_spans_every: int = 1  # a step span for every Nth step; 0 = none
    stop_enabled: bool = False  # request_stop() may checkpoint and stop the trainer
    stop_sync_steps: int = 10  # DDP agreement period, in optimizer steps
    collective_timing: bool = True  # wrap torch.distributed's collectives (collective_timing.py)

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> TracingSettings:
        """The environment (default: this process's) over the defaults; UsageError naming
        the variable on a bad value."""
        values, _origin = resolve(DECLARED, env=os.environ if env is None else env)
        return cls(**values)


OFF = TracingSettings(role="off")  # what a process whose telemetry is off runs with


def job_settings(env: Mapping[str, str] | None = None) -> TracingSettings:
    """The settings as the job's own code meets them (``phase()``, ``step()``, the Trainer and
    Lightning callbacks): a bad value turns telemetry off in this process, says so in one line
    on stderr (once, whichever API meets it first) and gives :data:`OFF`; never raises."""
    if context.turned_off():
        return OFF
    try:
        return TracingSettings.load(env)
    except UsageError as exc:
        context.turn_off(off_line(exc))
        return OFF


def off_line(error: Exception) -> str:
    """The one line a bad setting inside the job prints."""
    return f"otel-gpu: error: {error}; telemetry is off in this process"
