"""One frame of the live view: plain values copied out of a sweep (pure, no I/O).

Built on the sampler thread at a bounded cost (a few rows per GPU and per GPU process, capped),
then handed to the view's own thread, which renders it; the renderer never touches the
snapshot, the engine or the breaker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otel_gpu.core.printable import printable
from otel_gpu.core.units import gpu_label
from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN
from otel_gpu.detect.model import Alert
from otel_gpu.outputs.sweeps import Sweep, labels, short_model

MAX_GPU_ROWS = 16
MAX_PROCESS_ROWS = 8


@dataclass(frozen=True, slots=True)
class GpuRow:
    label: str  # GPU0 51a1a7ed
    model: str
    used: int | None
    limit: int | None
    util: float | None
    power_w: float | None
    temperature_c: float | None
    state: str  # the GPU's status (ok, degraded, failed), or its breaker's when not closed


@dataclass(frozen=True, slots=True)
class ProcessRow:
    pid: int
    name: str
    gpu: str  # GPU0
    used: int | None
    trend: float | None  # By/s: the engine's floor slope
    leaking: bool  # an open breaker on this process's memory
    cpu: float | None
    rss: int | None


@dataclass(frozen=True, slots=True)
class Frame:
    time: float  # data time of the sweep
    elapsed_s: float  # data time since the first sweep
    phase: str | None
    gpus: tuple[GpuRow, ...]
    processes: tuple[ProcessRow, ...]
    hidden_gpus: int = 0
    hidden_processes: int = 0
    breakers: dict[str, int] = field(default_factory=dict)  # state -> subjects in it (not closed)
    worst: str | None = None  # label of a subject whose breaker is open (else half-open)
    last_alert: Alert | None = None
    last_alert_label: str | None = None
    no_gpu_reason: str | None = None
    detecting: bool = True  # False with --no-detect: no breaker, no floor trend
    training: str | None = None  # the trainers' ``phase train  step 1234`` (agent/trainers.py)
    # Reads adaptive sampling slowed (OTEL_GPU_CPU_BUDGET): (kind, seconds between reads).
    slowed: tuple[tuple[str, float], ...] = ()


def _meant(observed_s: float, engine: Any, leaking: bool) -> bool:
    """Whether a floor rate means something yet: the view has watched for at least the
    shortest window the leak detector alerts from (an open breaker's always does). Before
    that, a warm-up ramp reads as a leak of thousands of MB/h."""
    if leaking:
        return True
    cfg = engine.config
    shortest = cfg.leak_min_window_s
    if cfg.leak_urgent_window_s > 0:
        shortest = min(shortest, cfg.leak_urgent_window_s)
    return observed_s >= shortest


def build_frame(
    sweep: Sweep,
    started: float,
    last_alert: Alert | None = None,
    training: str | None = None,
    seen: dict[int, str] | None = None,
) -> Frame:
    """The frame of ``sweep``; ``started`` is the data time of the first sweep; ``training``
    the trainers' phase and step for the title. ``seen``: the names of the rows' processes in
    the last frame, kept up to date here — a process that has just exited but that NVML still
    lists keeps the name it had (rather than ``?``)."""
    snap = sweep.snapshot
    names = labels(snap)
    states: dict[str, str] = {}
    if sweep.breaker is not None:
        for subject, _ in sweep.points:
            state = sweep.breaker.state(subject)
            if state != CLOSED:
                states[subject] = state
    gpus = []
    for g in snap.gpus[:MAX_GPU_ROWS]:
        state = states.get(f"gpu:{g.uuid}", g.status)
        gpus.append(
            GpuRow(
                gpu_label(g.index, g.uuid),
                short_model(g.name),
                g.memory_used,
                g.memory_total,
                g.util_gpu,
                g.power_w,
                g.temperature_c,
                state if g.status == "ok" else g.status,
            )
        )
    index = {g.uuid: g.index for g in snap.gpus}
    procs = {p.pid: p for p in snap.processes}
    on_gpu = sorted(snap.gpu_processes, key=lambda gp: -(gp.used_memory or 0))
    rows = []
    for gp in on_gpu[:MAX_PROCESS_ROWS]:
        local = snap.host_to_local.get(gp.pid, gp.pid)
        p = procs.get(local)
        subject = f"process:{gp.pid}@{gp.gpu_uuid}"
        trend = sweep.engine.floor_trend(subject) if sweep.engine is not None else None
        observed = snap.time - started
        if trend is not None and not _meant(observed, sweep.engine, states.get(subject) == OPEN):
            trend = None
        rows.append(
            ProcessRow(
                local,
                printable(
                    (p.executable_name if p is not None else None)
                    or (seen.get(local) if seen is not None else None)
                    or "?"
                ),
                gpu_label(index.get(gp.gpu_uuid), gp.gpu_uuid).split()[0],
                gp.used_memory,
                trend.rate if trend is not None else None,
                states.get(subject) == OPEN,
                p.cpu_utilization if p is not None else None,
                p.memory_rss if p is not None else None,
            )
        )
    if seen is not None:  # bounded: only the rows of this frame
        named = {r.pid: r.name for r in rows if r.name != "?"}
        seen.clear()
        seen.update(named)
    counts: dict[str, int] = {}
    for state in states.values():
        counts[state] = counts.get(state, 0) + 1
    worst = next((s for s, st in states.items() if st == OPEN), None) or next(
        (s for s, st in states.items() if st == HALF_OPEN), None
    )
    phase = next((p.phase for _, p in sweep.points if p.phase), None)
    return Frame(
        time=snap.time,
        elapsed_s=max(0.0, snap.time - started),
        phase=phase,
        gpus=tuple(gpus),
        processes=tuple(rows),
        hidden_gpus=max(0, len(snap.gpus) - MAX_GPU_ROWS),
        hidden_processes=max(0, len(on_gpu) - MAX_PROCESS_ROWS),
        breakers=counts,
        worst=None if worst is None else names.get(worst, worst),
        last_alert=last_alert,
        last_alert_label=None if last_alert is None else names.get(last_alert.subject),
        no_gpu_reason=None if snap.no_gpu_reason is None else printable(snap.no_gpu_reason),
        detecting=sweep.breaker is not None,
        training=None if training is None else printable(training),
        slowed=slowed_reads(snap.intervals),
    )


def slowed_reads(intervals: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """The kinds of read whose interval is longer than the GPU reads' (backed off)."""
    base = dict(intervals).get("gpu")
    return tuple((r, s) for r, s in intervals if base is not None and r != "gpu" and s > base)
