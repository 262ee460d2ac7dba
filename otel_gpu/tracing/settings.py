"""Tracing settings: ``OTEL_GPU_*`` environment > default, validated once.

A bad value raises :class:`~otel_gpu.errors.UsageError` naming the variable and what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from otel_gpu.errors import UsageError
from otel_gpu.tracing.environment_variables import (
    OTEL_GPU_ROLE,
    OTEL_GPU_STEP_SPANS_EVERY,
    OTEL_GPU_STOP,
    OTEL_GPU_STOP_SYNC_STEPS,
)

ROLES = ("auto", "launcher", "trainer", "node", "off")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class TracingSettings:
    """See README "Settings" for each variable."""

    role: str = "auto"
    step_spans_every: int = 1  # a step span for every Nth step; 0 = none
    stop_enabled: bool = False  # request_stop() may checkpoint and stop the trainer
    stop_sync_steps: int = 10  # DDP agreement period, in optimizer steps

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> TracingSettings:
        env = os.environ if env is None else env
        role = env.get(OTEL_GPU_ROLE, "auto").strip().lower() or "auto"
        if role not in ROLES:
            raise UsageError(f"{OTEL_GPU_ROLE}={role!r}: use one of {', '.join(ROLES)}")
        return cls(
            role=role,
            step_spans_every=_count(env, OTEL_GPU_STEP_SPANS_EVERY, 1, minimum=0),
            stop_enabled=_flag(env, OTEL_GPU_STOP),
            stop_sync_steps=_count(env, OTEL_GPU_STOP_SYNC_STEPS, 10, minimum=1),
        )


def _count(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise UsageError(f"{name}={raw!r}: use {minimum} or more")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise UsageError(f"{name}={raw!r}: use true or false")
