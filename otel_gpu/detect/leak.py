"""Leak detector: sustained, steady growth of a memory series' floor.

Method (per subject, bounded state: 4 levels x 32 envelope values):

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
from otel_gpu.detect.floor import FloorTrend, floor_trend
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
    """Bucket minima at one resolution, kept as their two-bucket lower envelope.

    A bucket closes when a sample of a later bucket arrives. Only the finest level sees every
    sample (O(1) each). A coarser bucket is the merge of the finer buckets it spans (bucket
    edges align: widths grow by LEVEL_FACTOR from one origin), so it is fed one closed finer
    bucket at a time and closes only when its finer level does.
    """

    __slots__ = (
        "width",
        "env_t",
        "env_y",
        "last_t",
        "last_y",
        "idx",
        "cur_min",
        "cur_tsum",
        "cur_n",
        "shapes",
    )

    def __init__(self, width: float) -> None:
        self.width = width
        # Envelope value i covers closed buckets i and i + 1: mean of their mean sample times,
        # min of their minima. Built once per close, so windows are plain slices.
        self.env_t: deque[float] = deque(maxlen=CAPACITY - 1)
        self.env_y: deque[float] = deque(maxlen=CAPACITY - 1)
        self.last_t = 0.0  # the latest closed bucket (valid once last_y is not None)
        self.last_y: float | None = None
        self.idx = -1
        self.cur_min = 0.0
        self.cur_tsum = 0.0
        self.cur_n = 0
        # The latest judgement of each window size.
        self.shapes: dict[int, WindowShape] = {}

    def merge(self, idx: int, low: float, tsum: float, n: int) -> None:
        """Add a closed finer bucket (or one sample: n == 1) to the open bucket ``idx``."""
        if self.cur_n == 0:
            self.idx = idx
            self.cur_min = low
            self.cur_tsum = tsum
            self.cur_n = n
        else:
            if low < self.cur_min:
                self.cur_min = low
            self.cur_tsum += tsum
            self.cur_n += n

    def close(self) -> None:
        t, y = self.cur_tsum / self.cur_n, self.cur_min
        if self.last_y is not None:
            self.env_t.append(0.5 * (self.last_t + t))
            self.env_y.append(min(self.last_y, y))
        self.last_t, self.last_y = t, y
        self.cur_n = 0

    def clear(self) -> None:
        self.env_t.clear()
        self.env_y.clear()
        self.last_y = None
        self.cur_n = 0
        self.idx = -1
        self.shapes.clear()


@dataclass(slots=True)
class WindowShape:
    """What a window says about the floor besides a possible leak (used to veto others).

    Drawdown and noise are only needed when another window is a leak candidate (rare), so
    they are computed from the window's floor values on first use.
    """

    length_s: float
    saturating: bool  # rising ever more slowly: a cache filling toward a cap
    ys: list[float]  # the window's floor values
    _drawdown_noise: tuple[float, float] | None = None

    def drawdown_noise(self, cfg: DetectConfig) -> tuple[float, float]:
        """(largest fall of the spike-filtered floor, robust bucket-to-bucket noise), bytes."""
        if self._drawdown_noise is None:
            self._drawdown_noise = shape_of(self.ys, cfg)
        return self._drawdown_noise


def shape_of(ys: list[float], cfg: DetectConfig) -> tuple[float, float]:
    """Drawdown and noise of a window's floor values; O(n log n), n <= 32."""
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
    return drawdown, max(noise, cfg.leak_noise_floor_bytes)


def _envelope(level: _Level, size: int) -> tuple[list[float], list[float]]:
    """The last ``size`` values of the two-bucket lower envelope of a level."""
    return list(level.env_t)[-size:], list(level.env_y)[-size:]


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

    __slots__ = (
        "cfg",
        "levels",
        "active",
        "active_window",
        "last_procs",
        "limit",
        "last_floor",
        "_trend",
    )

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.levels = [_Level(cfg.leak_bucket_s * LEVEL_FACTOR**k) for k in range(LEVELS)]
        self.active = False
        self.active_window = 0.0
        self.last_procs: int | None = None
        self.limit: float | None = None
        self.last_floor: float | None = None
        self._trend: tuple[tuple[int, float], FloorTrend] | None = None

    def trend(self) -> FloorTrend | None:
        """The floor and its recent slope (see :mod:`otel_gpu.detect.floor`), recomputed only
        when the finest level closed a bucket since the last call, so a display may ask after
        every sample."""
        fine = self.levels[0]
        if not fine.env_y:
            return None
        key = (len(fine.env_y), fine.env_t[-1])
        if self._trend is None or self._trend[0] != key:
            self._trend = (key, floor_trend(self.levels))
        return self._trend[1]

    def reset(self) -> None:
        for level in self.levels:
            level.clear()
        self.active = False
        self.last_floor = None
        self._trend = None

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
            return None
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

        finding: LeakFinding | None = None
        for level in levels[:closed]:
            found = self._judge_level(level)
            if found is not None and finding is None:
                finding = found
        if fine.last_y is not None:
            self.last_floor = fine.last_y
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
                if len(level.env_y) < size:
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
            env_t, env_y = level.env_t, level.env_y
            if len(env_y) < size:
                continue
            # Lower envelope over two adjacent buckets: drops one-bucket peaks (an evaluation
            # without phase information) and buckets that missed the trough of a sawtooth
            # slower than one bucket (aliasing would otherwise fake a slow rise).
            # Length and end values first: most windows are too short to judge at all.
            length = env_t[-1] - env_t[-size]
            if length < cfg.leak_min_window_s and not self._may_be_urgent(
                length, env_y[-size], env_y[-1]
            ):
                continue
            ts, ys = _envelope(level, size)
            found, saturating = judge(ts, ys, self.limit, cfg)
            if length >= 0.9 * cfg.leak_min_window_s:
                # Only windows this long can veto a candidate (see _vetted).
                level.shapes[size] = WindowShape(length, saturating, ys)
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
