"""Synthetic GPU job traces with known ground truth, for tests, benchmarks and demos.

``generate(shape, seed=..., interval_s=..., noise=..., columns=...)`` returns a ``Trace``: points
plus the label (``benign``, ``leak`` or ``stall``) and the onset time. Shapes cover what must not
alarm (warm-up, allocator staircase, evaluation and GC sawtooth, KV cache filling to a cap,
sequence-length curriculum, another tenant, long checkpoint saves without phase information,
input-bound training, a finished job) and what must (leaks of any rate, idle and spinning
stalls). Deterministic for a given seed; pure (``write_csv`` is the only I/O).
"""

from __future__ import annotations

import csv
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.detect.model import Point, point
from otel_gpu.detect.trace import REQUIRED

GB = 1e9
MIB = float(1 << 20)
BENIGN = (
    "flat",
    "warmup",
    "staircase",
    "eval_sawtooth",
    "gc_sawtooth",
    "kvcache",
    "curriculum",
    "tenant",
    "longsave",
    "inputbound",
    "finished",
)
FAULTS = ("leak", "stall_idle", "stall_spin")
COLUMNS_FULL = ("util", "procs", "phase", "power_w", "power_limit_w")


@dataclass
class Trace:
    """A generated trace and its ground truth."""

    name: str
    label: str  # "benign", "leak" or "stall"
    onset_s: float | None
    points: list[Point]
    rate_bytes_per_s: float | None = None
    columns: tuple[str, ...] = COLUMNS_FULL
    notes: dict[str, float] = field(default_factory=dict)


def generate(
    shape: str,
    *,
    seed: int = 0,
    interval_s: float = 15.0,
    duration_s: float = 8 * 3600.0,
    noise: str = "inproc",
    columns: tuple[str, ...] = COLUMNS_FULL,
    rate_mb_per_h: float = 400.0,
    onset_s: float | None = None,
) -> Trace:
    """One trace. ``noise``: "nvml" (quantized, steady) or "inproc" (per-batch jitter)."""
    rng = random.Random(f"{shape}/{seed}/{interval_s}/{noise}")
    limit = rng.choice((80 * 1024**3, 141e9, 151397597184.0))
    base = rng.uniform(0.25, 0.6) * limit
    load_s = rng.uniform(120, 480)
    jitter = rng.uniform(0.1, 0.5) * GB if noise == "inproc" else 0.0
    power_limit = 700.0
    idle_power = rng.uniform(60, 90)
    eval_period = rng.uniform(1.5, 3) * 3600 if noise == "inproc" else math.inf
    eval_len = rng.uniform(120, 300)
    eval_extra = rng.uniform(0.5, 3) * GB
    if onset_s is None:
        onset_s = rng.uniform(0.15, 0.4) * duration_s
    label, onset, rate = "benign", None, None
    extra_mem: Callable[[float], float] = lambda t: 0.0  # noqa: E731
    procs_at: Callable[[float], int] = lambda t: 1  # noqa: E731
    activity: Callable[[float], tuple[float, float, str | None]] | None = None

    def train_activity(t: float) -> tuple[float, float, str | None]:
        u = min(1.0, max(0.0, rng.gauss(0.92, 0.04)))
        return u, idle_power + (power_limit * 0.85 - idle_power) * u * rng.uniform(0.9, 1.05), None

    if shape == "flat":
        pass
    elif shape == "warmup":
        amount, tau = rng.uniform(1, 8) * GB, rng.uniform(300, 1500)
        extra_mem = lambda t: amount * (1 - math.exp(-max(0.0, t - load_s) / tau))  # noqa: E731
    elif shape == "staircase":
        steps = sorted(load_s + rng.uniform(60, 5400) for _ in range(rng.randint(3, 6)))
        sizes = [rng.uniform(0.2, 2) * GB for _ in steps]
        extra_mem = lambda t: sum(s for at, s in zip(steps, sizes, strict=True) if t >= at)  # noqa: E731
    elif shape == "gc_sawtooth":
        period, amount = rng.uniform(600, 3600), rng.uniform(0.5, 4) * GB
        extra_mem = lambda t: amount * ((max(0.0, t - load_s) % period) / period)  # noqa: E731
    elif shape == "eval_sawtooth":
        eval_period = rng.uniform(0.5, 1.5) * 3600
    elif shape == "kvcache":
        cap = rng.uniform(0.15, 0.35) * limit
        tau = rng.uniform(900, 3600)
        extra_mem = lambda t: _quantize(cap * (1 - math.exp(-max(0.0, t - load_s) / tau)))  # noqa: E731
    elif shape == "curriculum":
        steps = sorted(rng.uniform(0.1, 0.8) * duration_s for _ in range(rng.randint(2, 4)))
        sizes = [rng.uniform(2, 6) * GB for _ in steps]
        extra_mem = lambda t: sum(s for at, s in zip(steps, sizes, strict=True) if t >= at)  # noqa: E731
    elif shape == "tenant":
        spans = []
        t0 = rng.uniform(0.1, 0.3) * duration_s
        for _ in range(rng.randint(1, 3)):
            t1 = t0 + rng.uniform(0.05, 0.25) * duration_s
            spans.append((t0, t1, rng.uniform(2, 15) * GB, rng.uniform(0, 2) * GB))
            t0 = t1 + rng.uniform(0.02, 0.1) * duration_s

        def extra_mem(t: float) -> float:  # the tenant's memory also grows while it loads
            return sum(m + g * min(1.0, (t - a) / 1800) for a, b, m, g in spans if a <= t < b)

        procs_at = lambda t: 1 + sum(1 for a, b, _, _ in spans if a <= t < b)  # noqa: E731
    elif shape == "longsave":
        period, pause = rng.uniform(1800, 4 * 3600), rng.uniform(180, 720)

        def activity(t: float) -> tuple[float, float, str | None]:
            if t > load_s and (t - load_s) % period > period - pause:
                u = rng.uniform(0, 0.03)
                return u, idle_power + rng.uniform(0, 15), "save"
            return train_activity(t)

    elif shape == "inputbound":
        level = rng.uniform(0.2, 0.45)

        def activity(t: float) -> tuple[float, float, str | None]:
            u = min(1.0, max(0.0, rng.gauss(level, 0.12)))
            if rng.random() < 0.05:
                u = rng.uniform(0, 0.05)  # waiting for a batch
            return u, idle_power + (power_limit * 0.8 - idle_power) * u, None

    elif shape == "finished":
        end = rng.uniform(0.4, 0.8) * duration_s
        procs_at = lambda t: 0 if t >= end else 1  # noqa: E731
    elif shape == "leak":
        label, onset = "leak", onset_s
        rate = rate_mb_per_h * 1e6 / 3600
        extra_mem = lambda t: _quantize(max(0.0, t - onset_s) * rate)  # noqa: E731
    elif shape in ("stall_idle", "stall_spin"):
        label, onset = "stall", onset_s
        spin = shape == "stall_spin"

        def activity(t: float) -> tuple[float, float, str | None]:
            if t >= onset_s:
                if spin:
                    return 1.0, idle_power + rng.uniform(10, 40), None
                return rng.uniform(0, 0.06), idle_power + rng.uniform(0, 20), None
            return train_activity(t)

    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(BENIGN + FAULTS)}")

    act = activity or train_activity
    points: list[Point] = []
    t = 0.0
    step = 0.0
    while t <= duration_s:
        procs = procs_at(t)
        phase: str | None
        if procs == 0:
            used, util, power, phase = 0.0, 0.0, idle_power * 0.8, None
        elif t < load_s:
            used = base * min(1.0, t / load_s)
            util, power, phase = rng.uniform(0, 0.05), idle_power + rng.uniform(0, 20), "load"
        else:
            used = base + extra_mem(t)
            util, power, phase = act(t)
            if phase is None:
                phase = "train"
            in_eval = (t - load_s) % eval_period < eval_len and t - load_s > eval_len
            if label == "stall" and onset is not None and t >= onset:
                in_eval = False  # a hung job does not reach its next evaluation
            if in_eval and phase == "train":
                phase = "evaluate"
                used += eval_extra
                util, power = util * 0.65, power * 0.7
            if jitter:
                used += rng.uniform(0, jitter)
            if util > 0.3:
                step += interval_s / 2
        used = min(used, limit)
        values: dict[str, Any] = {
            "used_bytes": float(_quantize(used)),
            "limit_bytes": float(limit),
        }
        optional: dict[str, object] = {
            "util": round(util, 3),
            "procs": procs,
            "phase": phase,
            "power_w": round(power, 1),
            "power_limit_w": power_limit,
        }
        for name in columns:
            if name in optional:
                values[name] = optional[name]
        points.append(point(t, values))
        t += interval_s
    return Trace(
        f"{shape}_{noise}_{interval_s:g}s_{seed}",
        label,
        onset,
        points,
        rate_bytes_per_s=rate,
        columns=columns,
    )


def _quantize(x: float) -> float:
    """NVML and the caching allocator report in 2 MiB steps."""
    return math.floor(x / (2 * MIB)) * 2 * MIB


def write_csv(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write in the ``otel-gpu analyze`` format (only the trace's columns)."""
    cols = [*REQUIRED, *trace.columns]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for p in trace.points:
            row = [f"{p.time:g}", f"{p.used_bytes:.0f}", f"{p.limit_bytes:.0f}"]
            for c in trace.columns:
                v = getattr(p, c)
                row.append("" if v is None else str(v))
            w.writerow(row)
