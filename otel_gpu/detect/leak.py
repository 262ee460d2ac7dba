"""Leak detector: sustained, steady growth of a memory series' floor.

Method (per subject, bounded state: 4 levels x 33 bucket minima):

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
   shared device) resets the evidence. One alert per leak; it re-arms when the floor stops
   rising or the evidence resets. The reported rate comes from the longest agreeing window.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from otel_gpu.detect.config import DetectConfig
from otel_gpu.detect.model import PHASE_EVALUATE, PHASE_LOAD, PHASE_SAVE, Point

LEVEL_FACTOR = 4
LEVELS = 4
CAPACITY = 33  # 32 two-bucket envelope values
WINDOWS = (16, 32)
_SKIP_PHASES = frozenset((PHASE_LOAD, PHASE_EVALUATE, PHASE_SAVE))
# A window this many times longer than the candidate may veto it as saturating.
_VETO_SPAN = 4.0


@dataclass(frozen=True, slots=True)
class LeakFinding:
    """A window judged to be a leak."""

    rate: float  # By/s, Theil-Sen slope of the floor
    window_s: float
    z: float  # rate / standard error
    floor: float  # fitted floor at the window's end, bytes
    eta_s: float | None  # seconds until the limit at this rate
    urgent: bool  # found on a short window because the memory runs out soon
    confidence: float  # 0.5 at the significance threshold, approaching 1 as evidence grows


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def theil_sen(ts: list[float], ys: list[float]) -> float:
    """Median of the pairwise slopes (robust to up to ~29% outlying points)."""
    slopes = []
    n = len(ts)
    for i in range(n - 1):
        ti, yi = ts[i], ys[i]
        for j in range(i + 1, n):
            dt = ts[j] - ti
            if dt > 0:
                slopes.append((ys[j] - yi) / dt)
    return median(slopes) if slopes else 0.0


class _Level:
    """Bucket minima at one resolution; a bucket closes when a later sample arrives."""

    __slots__ = ("width", "times", "mins", "idx", "cur_min", "cur_tsum", "cur_n", "shapes")

    def __init__(self, width: float) -> None:
        self.width = width
        self.times: deque[float] = deque(maxlen=CAPACITY)
        self.mins: deque[float] = deque(maxlen=CAPACITY)
        self.idx = -1
        self.cur_min = 0.0
        self.cur_tsum = 0.0
        self.cur_n = 0
        # The latest judgement of each window size.
        self.shapes: dict[int, WindowShape] = {}

    def add(self, t: float, y: float) -> bool:
        """Add a sample; True when it closed the previous bucket."""
        idx = math.floor(t / self.width)
        closed = False
        if idx != self.idx and self.cur_n:
            self.times.append(self.cur_tsum / self.cur_n)
            self.mins.append(self.cur_min)
            self.cur_n = 0
            closed = True
        if self.cur_n == 0:
            self.idx = idx
            self.cur_min = y
            self.cur_tsum = t
            self.cur_n = 1
        else:
            if y < self.cur_min:
                self.cur_min = y
            self.cur_tsum += t
            self.cur_n += 1
        return closed

    def clear(self) -> None:
        self.times.clear()
        self.mins.clear()
        self.cur_n = 0
        self.idx = -1
        self.shapes.clear()


@dataclass(frozen=True, slots=True)
class WindowShape:
    """What a window says about the floor besides a possible leak (used to veto others)."""

    length_s: float
    saturating: bool  # rising ever more slowly: a cache filling toward a cap
    drawdown: float  # largest fall of the (spike-filtered) floor, bytes
    noise: float  # robust bucket-to-bucket noise, bytes


def shape_of(ts: list[float], ys: list[float], cfg: DetectConfig) -> WindowShape:
    """Drawdown and noise of a window; cheap (O(n log n), n <= 32)."""
    n = len(ys)
    sm = ys  # already a two-bucket lower envelope, free of one-bucket spikes
    peak = sm[0]
    drawdown = 0.0
    for y in sm:
        if y > peak:
            peak = y
        elif peak - y > drawdown:
            drawdown = peak - y
    diffs = [ys[i + 1] - ys[i] for i in range(n - 1)]
    centre = median(diffs)
    noise = 1.4826 * median([abs(d - centre) for d in diffs]) / math.sqrt(2.0)
    return WindowShape(ts[-1] - ts[0], False, drawdown, max(noise, cfg.leak_noise_floor_bytes))


def _envelope(level: _Level, size: int) -> tuple[list[float], list[float]]:
    """The last ``size`` values of the two-bucket lower envelope of a level."""
    raw_t = list(level.times)[-size - 1 :]
    raw_y = list(level.mins)[-size - 1 :]
    ts = [0.5 * (raw_t[i] + raw_t[i + 1]) for i in range(size)]
    ys = [min(raw_y[i], raw_y[i + 1]) for i in range(size)]
    return ts, ys


def judge(
    ts: list[float], ys: list[float], limit: float | None, cfg: DetectConfig
) -> tuple[LeakFinding | None, bool]:
    """Judge one window of floor values: (finding or None, saturating?)."""
    n = len(ys)
    q = n // 4
    m = [median(ys[j * q : (j + 1) * q]) for j in range(4)]
    d = [m[1] - m[0], m[2] - m[1], m[3] - m[2]]
    # Cheap exit, taken almost always on healthy series: the floor must rise in every quarter.
    if d[0] <= 0 or d[1] <= 0 or d[2] <= 0:
        return None, False
    if m[3] - m[0] < cfg.leak_min_rise_bytes * 0.5:
        return None, False
    # The last quarter grows much less than the first, by more than noise could explain:
    # filling toward a cap (or the tail of a warm-up), not a steady leak.
    ratio = cfg.leak_saturation_ratio
    # (d2 < ratio * d1 too: a warm-up followed by a steady leak rises fast, then steadily.)
    if d[2] < ratio * ratio * d[0] and d[2] < ratio * d[1]:
        diffs = [ys[i + 1] - ys[i] for i in range(n - 1)]
        mid = median(diffs)
        noise = 1.4826 * median([abs(x - mid) for x in diffs]) / math.sqrt(2.0)
        # d0 - d2 sums four quarter medians, each with standard error ~1.25 noise / sqrt(q).
        if d[0] - d[2] > 3.0 * 2.0 * 1.25 * noise / math.sqrt(q):
            return None, True

    t0 = ts[0]
    rel = [t - t0 for t in ts]
    rate = theil_sen(rel, ys)
    window = rel[-1]
    if rate < cfg.leak_min_rate_bytes_per_s or rate * window < cfg.leak_min_rise_bytes:
        return None, False
    resid = [y - rate * t for t, y in zip(rel, ys, strict=True)]
    centre = median(resid)
    sigma = 1.4826 * median([abs(r - centre) for r in resid])
    sigma = max(sigma, cfg.leak_noise_floor_bytes)
    mean_t = sum(rel) / n
    sd_t = math.sqrt(sum((t - mean_t) ** 2 for t in rel) / n)
    if sd_t <= 0:
        return None, False
    # Adjacent values share a bucket (two-bucket envelope): about n / 2 independent ones.
    z = rate * sd_t * math.sqrt(n / 2) / sigma
    if z < cfg.leak_min_z:
        return None, False

    # Growth spread over time: every quarter carries its share of the expected rise.
    mt = [median(rel[j * q : (j + 1) * q]) for j in range(4)]
    spread = cfg.leak_min_spread
    for j in range(3):
        if d[j] < spread * rate * (mt[j + 1] - mt[j]):
            return None, False
    # Steady, not slowing down: the second half climbs at least leak_steady_ratio as fast as
    # the first (a cache approaching its cap decelerates, a leak does not).
    half = n // 2
    first = theil_sen(rel[:half], ys[:half])
    second = theil_sen(rel[half:], ys[half:])
    if second < cfg.leak_steady_ratio * first:
        return None, False
    # ... and from many steps, not a few jumps (participation ratio of the rises).
    total = 0.0
    squares = 0.0
    for i in range(n - 1):
        step = ys[i + 1] - ys[i]
        if step > 0:
            total += step
            squares += step * step
    if squares <= 0 or total * total / squares < cfg.leak_min_steps:
        return None, False

    floor = centre + rate * window
    eta = None
    if limit is not None and limit > 0:
        eta = max(0.0, (limit - floor) / rate)
    confidence = min(0.999, 1.0 - 0.5 ** (z / cfg.leak_min_z))
    return LeakFinding(rate, window, z, floor, eta, False, confidence), False


class LeakState:
    """Per-subject leak evidence. ``observe`` returns a finding when a leak starts."""

    __slots__ = ("cfg", "levels", "active", "active_window", "last_procs", "limit", "last_floor")

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.levels = [_Level(cfg.leak_bucket_s * LEVEL_FACTOR**k) for k in range(LEVELS)]
        self.active = False
        self.active_window = 0.0
        self.last_procs: int | None = None
        self.limit: float | None = None
        self.last_floor: float | None = None

    def reset(self) -> None:
        for level in self.levels:
            level.clear()
        self.active = False
        self.last_floor = None

    def observe(self, p: Point) -> LeakFinding | None:
        used = p.used_bytes
        if used is None:
            return None
        if p.limit_bytes is not None and p.limit_bytes > 0:
            self.limit = p.limit_bytes
        if p.procs is not None:
            if self.last_procs is not None and p.procs != self.last_procs:
                # Another tenant came or went: its memory is not this job's growth.
                self.reset()
            self.last_procs = p.procs
            if p.procs == 0:
                self.reset()
                return None
        held = self.cfg.stall_min_held_bytes
        if used <= held:
            self.reset()  # released: job finished or restarted
            return None
        if self.last_floor is not None and used < 0.5 * self.last_floor:
            self.reset()  # the floor halved: a restart or a different workload
        if p.phase in _SKIP_PHASES:
            return None

        finding: LeakFinding | None = None
        for level in self.levels:
            if not level.add(p.time, used):
                continue
            found = self._judge_level(level)
            if found is not None and finding is None:
                finding = found
        if self.levels[0].mins:
            self.last_floor = self.levels[0].mins[-1]
        if finding is not None and not self.active:
            self.active = True
            self.active_window = finding.window_s
            return self._refined(finding)
        return None

    def _refined(self, found: LeakFinding) -> LeakFinding:
        """The longest window that also shows a steady leak gives the best rate estimate."""
        best = found
        for level in self.levels:
            for size in WINDOWS:
                if len(level.mins) < size + 1:
                    continue
                ts, ys = _envelope(level, size)
                if ts[-1] - ts[0] <= best.window_s:
                    continue
                longer, _ = judge(ts, ys, self.limit, self.cfg)
                if longer is not None:
                    best = dataclasses.replace(longer, urgent=found.urgent)
        return best

    def _judge_level(self, level: _Level) -> LeakFinding | None:
        cfg = self.cfg
        best: LeakFinding | None = None
        for size in WINDOWS:
            if len(level.mins) < size + 1:
                continue
            # Lower envelope over two adjacent buckets: drops one-bucket peaks (an evaluation
            # without phase information) and buckets that missed the trough of a sawtooth
            # slower than one bucket (aliasing would otherwise fake a slow rise).
            ts, ys = _envelope(level, size)
            length = ts[-1] - ts[0]
            if length < cfg.leak_min_window_s and not self._may_be_urgent(length, ys):
                continue
            found, saturating = judge(ts, ys, self.limit, cfg)
            if length >= 0.9 * cfg.leak_min_window_s:
                # Only windows this long can veto a candidate (see _vetted).
                shape = shape_of(ts, ys, cfg)
                level.shapes[size] = WindowShape(length, saturating, shape.drawdown, shape.noise)
            if self.active and length >= self.active_window:
                q = size // 4
                if median(ys[-q:]) <= median(ys[:q]):
                    self.active = False  # the floor stopped rising: the condition cleared
            if found is None or best is not None:
                continue
            if found.window_s < cfg.leak_min_window_s:
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

    def _may_be_urgent(self, length: float, ys: list[float]) -> bool:
        """Crude rate (last - first) reaches the limit within the urgent horizon."""
        if self.limit is None or length <= 0:
            return False
        crude = (ys[-1] - ys[0]) / length
        return crude > 0 and (self.limit - ys[-1]) <= 2 * crude * self.cfg.leak_urgent_eta_s

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
                if shape.drawdown > min(rise, max(0.5 * rise, 6.0 * shape.noise)):
                    return False
        return context
