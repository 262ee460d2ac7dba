"""Leak detector: sustained, steady growth of a memory series' floor.

Method (per subject, bounded state: 4 levels x 64/64/32/32 envelope values):

1. The memory series is decimated into bucket minima at four resolutions (``leak_bucket_s``
   x 1, 4, 16, 64). Windows are judged on the two-bucket lower envelope of the minima, the
   floor the job keeps returning to: per-batch peaks, evaluation spikes and a sawtooth's
   crests drop out. Load, evaluate and save phases (when known) are left out entirely.
2. When a bucket closes, the last 16 and 32 envelope values of that level form a window:
   - rate: Theil-Sen slope (median of pairwise slopes, robust to outlying buckets);
   - significance: rate / standard error >= ``leak_min_z``, noise = MAD of the residuals;
   - spread: each quarter rises by at least ``leak_min_spread`` of what the rate predicts,
     the second half climbs at least ``leak_steady_ratio`` as fast as the first, and the rise
     comes from at least ``leak_min_steps`` effective steps (participation ratio), so warm-up
     ramps, allocator staircases, curriculum steps and a tenant's arrival are not leaks;
   - minimum rate and rise (``leak_min_rate_bytes_per_s``, ``leak_min_rise_bytes``).
3. Longer windows (up to 4x) can veto: growth slowing from quarter to quarter beyond noise (a
   KV cache filling toward a cap), or the floor falling back by more than the rise (GC or
   evaluation sawtooth). Windows under ``leak_context_s`` also need a look-back twice their
   length before they may alert, so a cache's cap can be seen first.
4. Windows shorter than ``leak_min_window_s`` (but >= ``leak_urgent_window_s``) alert only
   when the memory runs out within ``leak_urgent_eta_s`` at the measured rate.
5. The floor halving, memory released, or a change of the process count (another tenant on a
   shared device) resets the evidence. One alert per leak; the reported rate comes from the
   longest agreeing window. A finding is only alerted while the floor still rises now (the
   shortest window of an ordinary alert's length agrees), so growth that ended is not news.
6. The suspicion stage (``suspect.py``: a CUSUM per finer level) dates where the floor began
   to rise. While one stands, the growth since that change point is judged on its own
   (``growth.py``): a leak once it is ``leak_suspect_window_s`` long, passes the tests of 2.,
   rose from a flat floor with no release before it, and is steadier than a cache filling with
   time constant ``leak_cache_tau_s`` could be; no look-back needed, so a clear leak is
   confirmed about half an hour after it starts. Any finding whose growth since the change
   point slows down beyond noise is vetoed (a cache that began filling after a flat stretch,
   which the fixed windows straddle and so cannot see slow down).
7. The leak stays *active* (a Condition) until a window at least as long as the one that found
   it shows the floor no longer rising, or the evidence resets; meanwhile its rate and time to
   exhaustion are re-estimated from that window as buckets close.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

from otel_gpu.core.units import duration, memory
from otel_gpu.detect.detector import NO_ALERTS, Condition
from otel_gpu.detect.floor import (
    CAPACITIES,
    LEVEL_FACTOR,
    LEVELS,
    FloorLevel,
    FloorTrend,
    LeakFinding,
    WindowShape,
    envelope,
    floor_trend,
    judge,
    median,
    theil_sen,
)
from otel_gpu.detect.growth import confirm, decelerating
from otel_gpu.detect.model import (
    LEAK,
    PHASE_EVALUATE,
    PHASE_LOAD,
    PHASE_SAVE,
    Alert,
    Point,
    canonical_phase,
)
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.detect.suspect import Cusum, threshold

WINDOWS = (16, 32)
_SKIP_PHASES = frozenset((PHASE_LOAD, PHASE_EVALUATE, PHASE_SAVE))
# A window this many times longer than the candidate may veto it as saturating.
_VETO_SPAN = 4.0
SUSPECT_LEVELS = 3  # the finest levels a suspicion CUSUM watches


class LeakDetector:
    """The leak evidence of one subject (a detector.Detector). ``observe`` alerts when a leak
    starts; while it is active, ``rate`` and ``exhaust_at`` follow the floor (see ``_track``)."""

    KINDS: ClassVar[tuple[str, ...]] = (LEAK,)
    __slots__ = (
        "cfg",
        "levels",
        "active",
        "active_window",
        "last_procs",
        "limit",
        "last_floor",
        "since",
        "rate",
        "exhaust_at",
        "tracked",
        "_trend",
        "suspects",
        "suspected_at",
        "_relaxed",
    )

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.levels = [
            FloorLevel(cfg.leak_bucket_s * LEVEL_FACTOR**k, CAPACITIES[k]) for k in range(LEVELS)
        ]
        self.active = False
        self.active_window = 0.0
        self.last_procs: int | None = None
        self.limit: float | None = None
        self.last_floor: float | None = None
        self.since = 0.0  # data time the active leak was alerted
        self.rate = 0.0  # By/s, the current estimate while active
        self.exhaust_at: float | None = None  # data time the limit is reached at that rate
        self.tracked = False  # the active leak was re-estimated at this point already
        self._trend: tuple[tuple[int, float], FloorTrend | None] | None = None
        # The suspicion stage (suspect.py): one CUSUM per finer level (a sawtooth's floor is
        # noisy per minute but clear per 16 minutes); none when turned off.
        self.suspects: tuple[Cusum, ...] = ()
        if cfg.leak_suspect_enabled:
            self.suspects = tuple(
                Cusum(
                    threshold(cfg.leak_suspect_per_day / SUSPECT_LEVELS, level.width),
                    cfg.leak_noise_floor_bytes,
                )
                for level in self.levels[:SUSPECT_LEVELS]
            )
        self.suspected_at: float | None = None  # data time of the latest suspicion's start
        # The trend tests of the growth since a suspicion's change point (growth.py).
        self._relaxed = cfg.replace(
            leak_min_z=min(cfg.leak_min_z, cfg.leak_suspect_min_z),
            leak_min_steps=min(cfg.leak_min_steps, cfg.leak_suspect_min_steps),
        )

    @classmethod
    def enabled(cls, cfg: DetectConfig) -> bool:
        return cfg.leak_enabled

    def conditions(self, now: float) -> Sequence[Condition]:
        if not self.active:
            return ()
        eta = None if self.exhaust_at is None else max(0.0, self.exhaust_at - now)
        return (Condition(LEAK, self.since, self.rate, eta),)

    def trend(self) -> FloorTrend | None:
        """The floor and its recent slope (:func:`floor.floor_trend`), recomputed only when the
        finest level closed a bucket since the last call, so a display may ask after every
        sample."""
        fine = self.levels[0]
        if not fine.env_y:
            return None
        key = (len(fine.env_y), fine.env_t[-1])
        if self._trend is None or self._trend[0] != key:
            self._trend = (key, floor_trend(self.levels))
        return self._trend[1]

    def suspected(self) -> float | None:
        """The data time the standing suspicion began (None: none stands)."""
        standing = [c.since for c in self.suspects if c.since is not None]
        return min(standing) if standing else None

    def reset(self) -> None:
        for c in self.suspects:
            c.reset()
        for level in self.levels:
            level.clear()
        self.active = False
        self.last_floor = None
        self._trend = None

    def observe(self, subject: str, p: Point) -> Sequence[Alert]:
        """Feed one point; the leak alert when a leak starts here."""
        used = p.used_bytes
        if used is None:
            return NO_ALERTS
        if p.limit_bytes is not None and p.limit_bytes > 0:
            self.limit = p.limit_bytes
        if p.procs is not None:
            if self.last_procs is not None and p.procs != self.last_procs:
                # Another tenant came or went: its memory is not this job's growth.
                self.reset()
            self.last_procs = p.procs
            if p.procs == 0:
                self.reset()
                return NO_ALERTS
        held = self.cfg.stall_min_held_bytes
        if used <= held:
            self.reset()  # released: job finished or restarted
            return NO_ALERTS
        if self.last_floor is not None and used < 0.5 * self.last_floor:
            self.reset()  # the floor halved: a restart or a different workload
        if p.phase is not None and canonical_phase(p.phase) in _SKIP_PHASES:
            return NO_ALERTS

        t = p.time
        levels = self.levels
        fine = levels[0]
        # floor(t / (w * 4**k)) == floor(t / w) // 4**k exactly (scaling by a power of two
        # commutes with rounding), so one division places the sample at every level.
        idx = math.floor(t / fine.width)
        if idx == fine.idx and fine.cur_n:
            # The common case: the sample stays in the open finest bucket; nothing closes.
            if used < fine.cur_min:
                fine.cur_min = used
            fine.cur_tsum += t
            fine.cur_n += 1
            return NO_ALERTS
        closed = 0
        if fine.cur_n:
            # Close the finest bucket and carry it up while the coarser buckets end too.
            low, tsum, n, prev = fine.cur_min, fine.cur_tsum, fine.cur_n, fine.idx
            fine.close()
            closed = 1
            for level in levels[1:]:
                prev //= LEVEL_FACTOR
                level.merge(prev, low, tsum, n)
                if idx // LEVEL_FACTOR**closed == level.idx:
                    break
                low, tsum, n = level.cur_min, level.cur_tsum, level.cur_n
                level.close()
                closed += 1
        fine.merge(idx, used, t, 1)
        for level, cusum in zip(levels[:closed], self.suspects, strict=False):
            if level.last_y is not None and cusum.feed(level.last_t, level.last_y):
                self.suspected_at = t

        finding: LeakFinding | None = None
        self.tracked = False
        for level in levels[:closed]:
            found = self._judge_level(level)
            if found is not None and finding is None:
                finding = found
        if fine.last_y is not None:
            self.last_floor = fine.last_y
        if self.active or not closed:
            return NO_ALERTS
        origins = [c.origin for c in self.suspects if c.origin is not None]
        if finding is not None and any(decelerating(levels, o, self.cfg) for o in origins):
            finding = None  # the growth since it began slows down: a cache filling up
        fast = False
        if finding is None:
            finding = self._confirmed(t)
            fast = finding is not None
        if finding is not None and self._still_rising(finding):
            self.active = True
            self.active_window = finding.window_s
            # The growth segment's own rate is the best estimate; a fixed window's improves
            # on the longest agreeing window.
            best = finding if fast else self._refined(finding)
            self.since, self.rate = t, best.rate
            self.exhaust_at = None if best.eta_s is None else t + best.eta_s
            # (a fast finding's window is its growth segment: it began a window before t)
            since = t - best.window_s if fast else None
            return (leak_alert(subject, p, best, since),)
        return NO_ALERTS

    def _confirmed(self, now: float) -> LeakFinding | None:
        """A standing suspicion confirmed by the growth since its change point (growth.py)."""
        # The change point of the finest standing suspicion: the most precise in time (a coarse
        # CUSUM a little above 0 when the growth began dates it too early, and a flat start
        # would hide how a cache slows down).
        for c in self.suspects:
            if c.since is not None and c.origin is not None:
                return confirm(self.levels, c.origin, now, self.limit, self._relaxed)
        return None

    def _refined(self, found: LeakFinding) -> LeakFinding:
        """The longest window that also shows a steady leak gives the best rate estimate."""
        best = found
        for level in self.levels:
            for size in WINDOWS:
                if len(level.env_y) < size:
                    continue
                ts, ys = envelope(level, size)
                if ts[-1] - ts[0] <= best.window_s:
                    continue
                longer, _ = judge(ts, ys, self.limit, self.cfg)
                if longer is not None:
                    best = dataclasses.replace(longer, urgent=found.urgent)
        return best

    def _judge_level(self, level: FloorLevel) -> LeakFinding | None:
        cfg = self.cfg
        min_window = shape_window = cfg.leak_min_window_s
        best: LeakFinding | None = None
        for size in WINDOWS:
            env_t, env_y = level.env_t, level.env_y
            if len(env_y) < size:
                continue
            # Lower envelope over two adjacent buckets: drops one-bucket peaks (an evaluation
            # without phase information) and buckets that missed the trough of a sawtooth
            # slower than one bucket (aliasing would otherwise fake a slow rise).
            # Length and end values first: most windows are too short to judge at all.
            length = env_t[-1] - env_t[-size]
            if length < 0.9 * shape_window and not self._may_be_urgent(
                length, env_y[-size], env_y[-1]
            ):
                continue
            ts, ys = envelope(level, size)
            found, saturating = judge(ts, ys, self.limit, cfg)
            if length >= 0.9 * shape_window:
                # Only windows this long can veto a candidate (see _vetted).
                level.shapes[size] = WindowShape(length, saturating, ys)
            if self.active and length >= self.active_window:
                self._track(ts, ys)
            if found is None or best is not None:
                continue
            if found.window_s < min_window:
                if (
                    found.eta_s is None
                    or found.eta_s > cfg.leak_urgent_eta_s
                    or found.window_s < 0.9 * cfg.leak_urgent_window_s
                ):
                    continue
                found = dataclasses.replace(found, urgent=True)
            elif not self._vetted(found):
                continue
            best = found
        return best

    def _track(self, ts: list[float], ys: list[float]) -> None:
        """While a leak is active, judge a window at least as long as the one that found it:
        the floor stopped rising (the condition cleared), or a current rate and exhaustion
        time (from the finest such window: the most recent evidence)."""
        q = len(ys) // 4
        if median(ys[-q:]) <= median(ys[:q]):
            self.active = False
            return
        if self.tracked:
            return
        self.tracked = True
        t0 = ts[0]
        rel = [t - t0 for t in ts]
        rate = theil_sen(rel, ys)
        if rate <= 0:
            return
        self.rate = rate
        if self.limit is None:
            self.exhaust_at = None
            return
        floor = median([y - rate * t for t, y in zip(rel, ys, strict=True)]) + rate * rel[-1]
        self.exhaust_at = ts[-1] + max(0.0, (self.limit - floor) / rate)

    def _still_rising(self, found: LeakFinding) -> bool:
        """Growth that has ended is not alerted: the shortest window as long as an ordinary
        alert's (or the finding's, if shorter) must still rise by ``leak_min_spread`` of what
        the finding's rate predicts. A long window may still judge a leak an hour after the
        floor went flat; this is the look at the present that it lacks."""
        need = 0.9 * min(found.window_s, self.cfg.leak_min_window_s)
        recent: tuple[list[float], list[float]] | None = None
        shortest = math.inf
        for level in self.levels:
            for size in WINDOWS:
                if len(level.env_y) < size:
                    continue
                length = level.env_t[-1] - level.env_t[-size]
                if need <= length < shortest:
                    shortest = length
                    recent = envelope(level, size)
        if recent is None:
            return True
        ts, ys = recent
        q = len(ys) // 4
        rise = median(ys[-q:]) - median(ys[:q])
        span = median(ts[-q:]) - median(ts[:q])
        return rise >= self.cfg.leak_min_spread * found.rate * span

    def _may_be_urgent(self, length: float, first: float, last: float) -> bool:
        """Crude rate (last - first) reaches the limit within the urgent horizon."""
        if self.limit is None or length <= 0:
            return False
        crude = (last - first) / length
        return crude > 0 and (self.limit - last) <= 2 * crude * self.cfg.leak_urgent_eta_s

    def _vetted(self, found: LeakFinding) -> bool:
        """Longer windows agree: no cache filling up, no release of memory, enough context."""
        length = found.window_s
        rise = found.rate * length
        # 0.9: bucket times are sample means, so a window spans slightly less than nominal.
        context = length >= 0.9 * self.cfg.leak_context_s
        for level in self.levels:
            for shape in level.shapes.values():
                if shape.length_s >= 1.9 * length:
                    context = True
                if shape.length_s > _VETO_SPAN * length or shape.length_s < 0.9 * length:
                    continue
                if shape.saturating:
                    return False
                # The floor fell back recently (GC or evaluation sawtooth): growth that gets
                # released is not a leak.
                drawdown, noise = shape.drawdown_noise(self.cfg)
                if drawdown > min(rise, max(0.5 * rise, 6.0 * noise)):
                    return False
        return context


def leak_alert(subject: str, p: Point, f: LeakFinding, rising_since: float | None = None) -> Alert:
    """The alert for a leak found at point ``p``; ``rising_since``: the data time the growth
    began, when the growth since a suspicion's change point confirmed it (growth.py)."""
    mb_per_h = f.rate * 3600 / 1e6
    parts = [
        f"memory leak suspected: floor rising {mb_per_h:.0f} MB/h "
        f"steadily over {duration(f.window_s)}"
    ]
    if p.limit_bytes:
        parts.append(f"at {memory(f.floor)} of {memory(p.limit_bytes)}")
    if f.eta_s is not None:
        parts.append(f"limit reached in ~{duration(f.eta_s)}")
    critical = f.urgent or (f.eta_s is not None and f.eta_s <= 3600)
    evidence: dict[str, float | str] = {
        "z": round(f.z, 2),
        "floor_bytes": f.floor,
        "urgent": str(f.urgent).lower(),
    }
    if rising_since is not None:
        evidence["rising_since_s"] = rising_since
    return Alert(
        kind=LEAK,
        subject=subject,
        time=p.time,
        severity="critical" if critical else "warning",
        message=", ".join(parts),
        rate_bytes_per_s=f.rate,
        eta_s=f.eta_s,
        window_s=f.window_s,
        confidence=f.confidence,
        evidence=evidence,
    )
