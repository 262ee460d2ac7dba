"""Stall detector ("fake running"): the job holds GPU memory while the GPU does no useful work.

A subject is idle when its smoothed utilization is near zero, or spinning when utilization is
pinned high at near-idle power (a hung collective). A stall is an idle or spinning run that
lasts ``stall_window_s`` while memory stays held, or training steps that stop advancing: in
the train phase for max(``stall_step_floor_s``, ``stall_step_factor`` x the typical step time),
the median of the recent ones (so a job stepping every second is judged within about a minute
and steps that slow down but keep coming are not a stall), stretched like the window by the
step pauses that ended on their own (an unmarked checkpoint save); without phase information for
max(window, factor x typical step time). Phases are read through ``canonical_phase`` (``eval``,
``val``, ``checkpoint``, ... are evaluate or save).

No alarm:
- during a known load, evaluate or save phase (up to ``stall_phase_max_s``);
- for pauses without phase information shorter than the window (checkpoint saves); idle runs
  that ended on their own stretch the window for this subject (a job that saves for 12 minutes
  every hour needs more than 12 minutes of idleness to be stalled);
- while memory is still moving (loading), or before the job has ever worked within
  ``stall_startup_window_s``;
- when memory is released or no process is left (the job finished);
- when steps advance (a slow, input-bound job is working).

A stall stays active (a Condition) until useful work resumes — activity lasting a smoothing
time constant, or steps advancing again — or the job lets go of the GPU.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from otel_gpu.core.units import duration, memory
from otel_gpu.detect.detector import NO_ALERTS, Condition
from otel_gpu.detect.model import (
    PHASE_EVALUATE,
    PHASE_LOAD,
    PHASE_SAVE,
    PHASE_TRAIN,
    STALL,
    Alert,
    Point,
    canonical_phase,
)
from otel_gpu.detect.settings import DetectConfig

_QUIET_PHASES = frozenset((PHASE_LOAD, PHASE_EVALUATE, PHASE_SAVE))
_GIB = float(1 << 30)
_GAPS = 15  # recent step times kept for the typical one (their median)

IDLE = "idle"
SPIN = "spin"
STEPS = "steps"
BUSY = "busy"


@dataclass(frozen=True, slots=True)
class StallFinding:
    """A stall that just started being certain."""

    mode: str  # IDLE, SPIN or STEPS
    since: float  # data time the idleness began
    duration_s: float
    util: float | None
    power_fraction: float | None
    used_bytes: float | None


class StallDetector:
    """The stall evidence of one subject, a handful of floats (a detector.Detector)."""

    KINDS: ClassVar[tuple[str, ...]] = (STALL,)
    __slots__ = (
        "cfg",
        "since",
        "last_t",
        "util_s",
        "power_s",
        "power_peak",
        "raw_idle_since",
        "raw_mode",
        "idle_since",
        "idle_used",
        "worked",
        "longest_recovered",
        "phase",
        "phase_since",
        "last_step",
        "step_changed",
        "step_interval",
        "step_gaps",
        "longest_freeze",
        "alerted",
        "steps_alerted",
        "power_frac",
        "busy_since",
        "idle_learnable",
        "alpha_dt",
        "alpha",
    )

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.since = 0.0  # data time of the latest stall alert
        self.last_t: float | None = None
        self.util_s: float | None = None
        self.power_s: float | None = None
        self.power_peak = 0.0
        self.raw_idle_since: float | None = None
        self.raw_mode: str | None = None
        self.idle_since: float | None = None
        self.idle_used: float | None = None
        self.worked = False
        self.longest_recovered = 0.0
        self.phase: str | None = None
        self.phase_since = 0.0
        self.last_step: float | None = None
        self.step_changed: float | None = None
        self.step_interval: float | None = None  # the typical step time (median of the gaps)
        self.step_gaps: deque[float] = deque(maxlen=_GAPS)
        self.longest_freeze = 0.0  # the longest train-phase step pause that ended on its own
        self.alerted = False
        self.steps_alerted = False
        self.power_frac: float | None = None
        self.busy_since: float | None = None
        self.idle_learnable = False
        self.alpha_dt = 0.0  # the smoothing factor for this interval (0 s: factor 0)
        self.alpha = 0.0

    @classmethod
    def enabled(cls, cfg: DetectConfig) -> bool:
        return cfg.stall_enabled

    def conditions(self, now: float) -> Sequence[Condition]:
        active = self.alerted or self.steps_alerted
        return (Condition(STALL, self.since),) if active else ()

    def _smooth(self, prev: float | None, value: float, dt: float) -> float:
        if prev is None:
            return value
        if dt != self.alpha_dt:  # sampling intervals repeat: one exp per new interval
            self.alpha_dt = dt
            self.alpha = 1.0 - math.exp(-dt / self.cfg.stall_smoothing_s)
        return prev + self.alpha * (value - prev)

    def _end_idle(self, t: float) -> None:
        if self.idle_since is not None and not self.alerted and self.idle_learnable:
            # A pause that ended on its own (e.g. a checkpoint save) teaches the window.
            self.longest_recovered = max(self.longest_recovered, t - self.idle_since)
        self.idle_since = None
        self.alerted = False

    def window(self) -> float:
        cfg = self.cfg
        base = cfg.stall_window_s if self.worked else cfg.stall_startup_window_s
        adapted = min(cfg.stall_window_max_s, cfg.stall_adapt_factor * self.longest_recovered)
        return max(base, adapted)

    def observe(self, subject: str, p: Point) -> Sequence[Alert]:
        """Feed one point; the stall alert when a stall becomes certain here."""
        t = p.time
        if p.util is None and p.power_w is None and (p.loss is not None or p.grad_norm is not None):
            return NO_ALERTS  # the trainer's numbers (numerics.py): no activity evidence here
        if p.step is None and p.util is None and p.power_w is None and self.last_step is not None:
            # A host-memory subject that carried the job's steps while no GPU was seen, and
            # carries them no more (a GPU appeared): its steps are judged elsewhere now. (A GPU
            # subject always brings util or power, so a trainer gone quiet is still judged.)
            self._forget_steps()
        if (
            p.util is None
            and p.power_w is None
            and p.step is None
            and self.util_s is None
            and self.power_s is None
            and self.last_step is None
        ):
            # Memory only (a process's RSS or GPU memory), and never any activity signal: the
            # full path below could only record the time and the phase, so do just that.
            self.last_t = t
            self.raw_idle_since = self.raw_mode = None
            phase = canonical_phase(p.phase)
            if phase != self.phase:
                self.phase = phase
                self.phase_since = t
            return NO_ALERTS
        cfg = self.cfg
        dt = 0.0 if self.last_t is None else max(0.0, t - self.last_t)
        self.last_t = t
        if p.util is not None:
            self.util_s = self._smooth(self.util_s, p.util, dt)
        if p.power_w is not None:
            self.power_s = self._smooth(self.power_s, p.power_w, dt)
        # The raw reading marks when a run really began; smoothing only confirms it.
        raw = self._raw_mode(p)
        if raw is None or raw == BUSY:
            self.raw_idle_since = None
        elif raw != self.raw_mode or self.raw_idle_since is None:
            self.raw_idle_since = t
        self.raw_mode = raw
        phase = canonical_phase(p.phase)
        if phase != self.phase:
            self.phase = phase
            self.phase_since = t

        # Not holding the GPU: finished or not started; nothing can be stalled. A point that
        # carries the job's step is judged by its steps whatever memory it holds (a trainer's
        # host memory on a host without GPUs is small): only no process at all ends it.
        limit = p.limit_bytes or 0.0
        held_min = max(cfg.stall_min_held_bytes, 0.01 * limit)
        if (p.procs is not None and p.procs <= 0) or (
            p.step is None and p.used_bytes is not None and p.used_bytes <= held_min
        ):
            self._end_idle(t)
            self.longest_recovered = 0.0
            self.worked = False
            self._forget_steps()
            return NO_ALERTS

        steps_moving = self._track_steps(t, p.step)
        mode = self._classify(p)
        if phase in _QUIET_PHASES and t - self.phase_since < cfg.stall_phase_max_s:
            # Sanctioned pause: not counted, and it does not stretch the window either.
            self.idle_since = None
            self.alerted = False
            return NO_ALERTS
        if steps_moving or self._steps_alive(t):
            # Steps advance at their usual pace: slow (input-bound) perhaps, but working.
            self.worked = True
            self._end_idle(t)
            self.raw_idle_since = None
            return NO_ALERTS
        if mode is None:
            return self._stuck_steps(subject, t, p)
        if mode == BUSY:
            self.worked = True
            if self.busy_since is None:
                self.busy_since = t
            # A blip of activity (a watchdog kernel, one metrics read) does not end a hang:
            # work must last a smoothing time constant and span two samples.
            if self.idle_since is None or (
                t - self.busy_since >= self.cfg.stall_smoothing_s and t > self.busy_since
            ):
                self._end_idle(t)
            return self._stuck_steps(subject, t, p)
        self.busy_since = None

        # Idle or spinning while holding memory.
        if self.idle_since is None:
            start = self.raw_idle_since if mode == self.raw_mode else None
            self.idle_since = t if start is None else start
            self.idle_used = p.used_bytes
            # Only pauses of a job that had worked teach the window (not model loading).
            self.idle_learnable = self.worked
        elif (
            p.used_bytes is not None
            and self.idle_used is not None
            and abs(p.used_bytes - self.idle_used) > max(0.05 * self.idle_used, _GIB)
        ):
            # Memory still moving: loading or reshaping, not hung. Restart the clock.
            self.idle_since = t
            self.idle_used = p.used_bytes
        duration = t - self.idle_since
        if not self.alerted and duration >= self.window():
            self.alerted = True
            if self.steps_alerted:
                return NO_ALERTS  # the same stall, already told by its frozen steps
            found = StallFinding(
                mode, self.idle_since, duration, self.util_s, self.power_frac, p.used_bytes
            )
            return self._alert(subject, p, found)
        return self._stuck_steps(subject, t, p)

    def _raw_mode(self, p: Point) -> str | None:
        cfg = self.cfg
        if p.util is None:
            return None
        if p.util < cfg.stall_util_idle:
            return IDLE
        if p.util >= cfg.stall_spin_util and p.power_w is not None:
            ref = p.power_limit_w if p.power_limit_w else self.power_peak
            if ref and p.power_w / ref <= cfg.stall_spin_power_fraction:
                return SPIN
        return BUSY

    def _classify(self, p: Point) -> str | None:
        """IDLE, SPIN, BUSY or None (unknown) from smoothed utilization and power."""
        cfg = self.cfg
        frac: float | None = None
        if self.power_s is not None:
            if p.power_limit_w is not None and p.power_limit_w > 0:
                frac = self.power_s / p.power_limit_w
            elif self.power_peak > 0:
                frac = self.power_s / self.power_peak  # no limit known: relative to busy power
            if self.util_s is not None and self.util_s >= 0.5:
                self.power_peak = max(self.power_peak, self.power_s)
        self.power_frac = frac
        if self.util_s is not None:
            if self.util_s < cfg.stall_util_idle:
                return IDLE
            if (
                self.util_s >= cfg.stall_spin_util
                and frac is not None
                and frac <= cfg.stall_spin_power_fraction
            ):
                return SPIN
            return BUSY
        if frac is not None:
            return IDLE if frac <= cfg.stall_spin_power_fraction else BUSY
        return None

    def _forget_steps(self) -> None:
        self.last_step = None
        self.step_interval = None
        self.step_gaps.clear()
        self.longest_freeze = 0.0
        self.steps_alerted = False

    def _track_steps(self, t: float, step: float | None) -> bool:
        """True when the step counter just advanced."""
        if step is None:
            return False
        if self.last_step is None or step < self.last_step:
            self.last_step = step
            self.step_changed = t
            return False
        if step > self.last_step:
            if self.step_changed is not None:
                if self.step_interval is not None and self.phase == PHASE_TRAIN:
                    # A pause in training that ended on its own (an unmarked checkpoint save):
                    # steps pausing that long again are that pause, not a hang. A pause longer
                    # than the stall window teaches nothing (a hang that came unstuck).
                    freeze = t - max(self.step_changed, self.phase_since)
                    if freeze < self.cfg.stall_window_s:
                        self.longest_freeze = max(self.longest_freeze, freeze)
                gaps = self.step_gaps
                gaps.append((t - self.step_changed) / (step - self.last_step))
                ordered = sorted(gaps)
                self.step_interval = ordered[len(ordered) // 2]
            self.last_step = step
            self.step_changed = t
            self.steps_alerted = False
            return True
        return False

    def _steps_alive(self, t: float) -> bool:
        if self.step_interval is None or self.step_changed is None:
            return False
        return t - self.step_changed <= 3 * self.step_interval

    def _alert(self, subject: str, p: Point, found: StallFinding) -> Sequence[Alert]:
        self.since = p.time
        return (stall_alert(subject, p, found),)

    def _stuck_steps(self, subject: str, t: float, p: Point) -> Sequence[Alert]:
        """Steps reported and advancing before, now frozen far longer than usual."""
        if self.step_interval is None or self.step_changed is None or self.steps_alerted:
            return NO_ALERTS
        cfg = self.cfg
        typical = cfg.stall_step_factor * self.step_interval
        if self.phase == PHASE_TRAIN:
            # Training, by the job's own word: its steps are the evidence, from the later of
            # the last step and the phase's start (after an evaluation, steps resume).
            since = max(self.step_changed, self.phase_since)
            learned = min(cfg.stall_window_max_s, cfg.stall_adapt_factor * self.longest_freeze)
            limit = max(cfg.stall_step_floor_s, typical, learned)
        else:
            since = self.step_changed
            limit = max(self.window(), typical)
        frozen = t - since
        if frozen >= limit:
            self.steps_alerted = True
            if self.alerted:
                return NO_ALERTS  # the same stall, already told by the GPU's idleness
            found = StallFinding(STEPS, since, frozen, self.util_s, self.power_frac, p.used_bytes)
            return self._alert(subject, p, found)
        return NO_ALERTS


def stall_alert(subject: str, p: Point, f: StallFinding) -> Alert:
    """The alert for a stall that became certain at point ``p``."""
    held = f" while holding {memory(f.used_bytes)}" if f.used_bytes else ""
    dur = duration(f.duration_s)
    if f.mode == SPIN:
        power = f" at {f.power_fraction:.0%} power" if f.power_fraction is not None else ""
        what = (
            f"GPU busy-spinning (util {f.util or 0:.0%}){power} for {dur}{held}: hung collective?"
        )
    elif f.mode == STEPS:
        step = f" at {p.step:g}" if p.step is not None else ""
        what = f"training step stuck{step} for {dur}{held}"
    else:
        util = f" (util {f.util:.0%})" if f.util is not None else ""
        what = f"GPU idle{util} for {dur}{held}"
    evidence: dict[str, float | str] = {"mode": f.mode, "since": f.since}
    if f.util is not None:
        evidence["util"] = round(f.util, 4)
    if f.power_fraction is not None:
        evidence["power_fraction"] = round(f.power_fraction, 4)
    return Alert(
        kind=STALL,
        subject=subject,
        time=p.time,
        severity="critical",
        message=f"stalled: {what}",
        window_s=f.duration_s,
        evidence=evidence,
    )
