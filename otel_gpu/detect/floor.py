"""The floor of a memory series and the judgement of one window of it (see ``leak.py``).

The floor is kept as bucket minima at several resolutions, each as a two-bucket lower
envelope, in bounded state: LEVELS levels x CAPACITIES values. ``judge`` says whether one window
of it shows a steady leak; the leak detector decides which windows to judge and when to alert.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from otel_gpu.detect.settings import DetectConfig

LEVEL_FACTOR = 4
LEVELS = 4
CAPACITY = 33  # 32 two-bucket envelope values
# The two finest levels keep twice as many: the growth since a suspicion's change point and the
# floor before it are read from them (growth.py), up to 64 min and 256 min back.
CAPACITIES = (2 * CAPACITY - 1, 2 * CAPACITY - 1, CAPACITY, CAPACITY)


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


class FloorLevel:
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

    def __init__(self, width: float, capacity: int = CAPACITY) -> None:
        self.width = width
        # Envelope value i covers closed buckets i and i + 1: mean of their mean sample times,
        # min of their minima. Built once per close, so windows are plain slices.
        self.env_t: deque[float] = deque(maxlen=capacity - 1)
        self.env_y: deque[float] = deque(maxlen=capacity - 1)
        self.last_t = 0.0  # the latest closed bucket (valid once last_y is not None)
        self.last_y: float | None = None
        self.idx = -1
        self.cur_min = 0.0
        self.cur_tsum = 0.0
        self.cur_n = 0
        # The latest judgement of each window size.
        self.shapes: dict[int, Any] = {}  # window size -> leak.WindowShape

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


def envelope(level: FloorLevel, size: int) -> tuple[list[float], list[float]]:
    """The last ``size`` values of the two-bucket lower envelope of a level."""
    return list(level.env_t)[-size:], list(level.env_y)[-size:]


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


def judge(
    ts: list[float],
    ys: list[float],
    limit: float | None,
    cfg: DetectConfig,
    *,
    kept: list[float] | None = None,
) -> tuple[LeakFinding | None, bool]:
    """Judge one window of floor values: (finding or None, saturating?). ``kept``: the values
    whose rises count as steps, if not ``ys`` (``growth.kept``: blocks freed later left out)."""
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
    if steps_in(ys if kept is None else kept) < cfg.leak_min_steps:
        return None, False

    floor = centre + rate * window
    eta = None
    if limit is not None and limit > 0:
        eta = max(0.0, (limit - floor) / rate)
    confidence = min(0.999, 1.0 - 0.5 ** (z / cfg.leak_min_z))
    return LeakFinding(rate, window, z, floor, eta, False, confidence), False


def steps_in(ys: list[float]) -> float:
    """The effective number of steps the rises of ``ys`` come from: their participation ratio
    (sum of the rises squared over the sum of their squares); 0 without a rise."""
    total = 0.0
    squares = 0.0
    for a, b in zip(ys, ys[1:], strict=False):
        step = b - a
        if step > 0:
            total += step
            squares += step * step
    return total * total / squares if squares > 0 else 0.0


def freed_later(ys: list[float], margin: float, longest: int) -> list[bool]:
    """Which values belong to a block held for at most ``longest`` values in a row and freed
    since: each stands more than ``margin`` above a later value. Such a transient is not growth
    of the floor, and what the floor under it did while it was held is unknown, so callers
    leave these values out. A longer run is the floor itself falling back (a sawtooth's tooth,
    a cache emptied): that is kept. The floor's own noise stays below a margin of a few noise
    units, and a floor that only rises has none."""
    n = len(ys)
    out = [False] * n
    low = math.inf
    for i in range(n - 1, -1, -1):
        out[i] = ys[i] - low > margin
        low = min(low, ys[i])
    i = 0
    while i < n:
        if not out[i]:
            i += 1
            continue
        j = i
        while j < n and out[j]:
            j += 1
        if j - i > longest:
            out[i:j] = [False] * (j - i)
        i = j
    return out


# -- the floor as a display reads it (live view, summary, report) ----------------------------

# A slope needs this many envelope values of one level (fewer say nothing about a slope).
TREND_MIN_VALUES = 6
# The recent trend: the last values of one level, as many as the detector's short window.
TREND_VALUES = 16


@dataclass(frozen=True, slots=True)
class FloorTrend:
    """Where a memory floor is and how fast it moves, leak or not."""

    time: float  # data time of the latest floor value
    floor: float  # bytes: the latest two-bucket lower envelope value of the finest level
    rate: float | None  # By/s, Theil-Sen slope of the floor; None until enough buckets closed
    window_s: float  # the span the rate was fitted over


def floor_trend(levels: list[FloorLevel]) -> FloorTrend | None:
    """Slope over the last 16 values of the coarsest level that has them (the recent trend,
    not a warm-up long past), else over the finest level once it holds a few values."""
    fine = levels[0]
    if not fine.env_y:
        return None
    chosen = next((lv for lv in reversed(levels) if len(lv.env_y) >= TREND_VALUES), fine)
    rate: float | None = None
    window = 0.0
    if len(chosen.env_y) >= TREND_MIN_VALUES:
        ts = list(chosen.env_t)[-TREND_VALUES:]
        ys = list(chosen.env_y)[-TREND_VALUES:]
        rate = theil_sen([t - ts[0] for t in ts], ys)
        window = ts[-1] - ts[0]
    return FloorTrend(fine.env_t[-1], fine.env_y[-1], rate, window)
