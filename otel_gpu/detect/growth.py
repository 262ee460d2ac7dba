"""The growth since a suspicion's change point, judged on its own (issue 20 §1).

A standing suspicion (``suspect.py``) says when the floor began to rise: its CUSUM's change
point. The fixed windows of ``leak.py`` straddle that point, so they need an hour of growth
and a look-back twice as long before they may alert, and a cache that starts filling after a
flat stretch shows them no deceleration (their first quarters are flat). Here the growth,
from where it began to now, is judged directly, on one level's envelope (the finest holding
it and the baseline before it, at least ``BASELINE_VALUES`` of that level's buckets long; a
coarser level's minima sit lower on a noisy floor). A noisy growth that outlasts the hour the
finest level holds is so judged on the next, instead of only by the fixed windows:

* **confirm** (the fast path), once the growth is ``leak_suspect_window_s`` long:
  - where it began: the floor stays ``RUN`` values above its baseline (the half window before
    the change point) by 3 noise units; the line through the values from there meets the
    baseline's level at the start (neither the first value above it, which noise picks, nor
    a change point dated early, whose flat stretch would hide how a cache slows down);
  - the ordinary trend tests (``floor.judge``: significance, spread, steadiness, many steps,
    minimum rate and rise, with ``leak_suspect_min_z`` and ``leak_suspect_min_steps``), the
    steps counted without the blocks held for a few values and freed since (``kept``);
  - steadier than a cache: a cache filling toward its cap with time constant ``tau`` climbs
    exp(-D / 2 tau) as fast in the second half of D as in the first, a leak as fast. Each
    half's Theil-Sen slope (allocator steps taken out) must exceed that fraction of the
    other's by ``SLOWDOWN_Z`` standard errors (robust noise about each half's own line, one
    value in ``INDEPENDENT`` independent, blocks freed since left out), with
    ``tau = leak_cache_tau_s``. Clean growth
    passes after ``leak_suspect_window_s``; noisy growth when D has grown enough;
  - a flat floor before it: no release just before (a sawtooth's next tooth), every quarter
    of the baseline at or below the growth's start, and rising at most ``BASELINE_SLOPE`` as
    fast (a warm-up, or a growth that began with the job, has no such baseline).
* **decelerating** (a veto for every other alert): the growth since the change point climbs
  significantly slower in its second half than ``leak_saturation_ratio`` of its first, with
  and without its steps: a cache filling, whatever window found it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from otel_gpu.detect.floor import (
    FloorLevel,
    LeakFinding,
    freed_later,
    judge,
    median,
    shape_of,
    theil_sen,
)
from otel_gpu.detect.settings import DetectConfig

MIN_VALUES = 16  # envelope values a growth segment is judged on
BASELINE_VALUES = 8  # ... and the floor before it
SLOWDOWN_Z = 3.0  # one-sided standard errors of the steadiness test (~0.1 %)
INDEPENDENT = 3.0  # envelope values per independent one, for the steadiness test's error
STEP_SHARE = 0.2  # a jump carrying this share of a segment's rise is a step, not growth
RUN = 4  # envelope values in a row above the baseline where the rise starts
BASELINE_SLOPE = 0.25  # the floor before the growth rose at most this fraction as fast
FREED = 6.0  # noise units a value stands above a later one to be a block freed since
FREED_RUN = 8  # ... held for at most this many values in a row (longer: the floor fell back)
Values = tuple[list[float], list[float]]


def segment(levels: Sequence[FloorLevel], start: float) -> Values | None:
    """The envelope values since ``start``, from the finest level that reaches back to it;
    None if it holds fewer than MIN_VALUES of them (coarser levels hold fewer still)."""
    for level in levels:
        env_t = level.env_t
        if not env_t or env_t[0] > start:
            continue
        ts, ys = _after(level, start)
        return (ts, ys) if len(ts) >= MIN_VALUES else None
    return None


def _after(level: FloorLevel, start: float) -> Values:
    ts = list(level.env_t)
    ys = list(level.env_y)
    i = len(ts)
    while i > 0 and ts[i - 1] >= start:
        i -= 1
    return ts[i:], ys[i:]


def slowdown_z(
    ts: list[float], ys: list[float], ratio: float, cfg: DetectConfig, *, both: bool = False
) -> float:
    """How many standard errors the second half's slope exceeds ``ratio`` x the first's (with
    ``both``: the smaller of that and how far the first's exceeds ``ratio`` x the second's)."""
    n = len(ys)
    half = n // 2
    t0 = ts[0]
    rel = [t - t0 for t in ts]
    first = theil_sen(rel[:half], ys[:half])
    second = theil_sen(rel[half:], ys[half:])
    # Noise: the residuals about each half's own line (a straight line through both halves
    # would count a cache's curvature as noise).
    dev: list[float] = []
    for part_t, part_y, slope in ((rel[:half], ys[:half], first), (rel[half:], ys[half:], second)):
        resid = [y - slope * t for t, y in zip(part_t, part_y, strict=True)]
        centre = median(resid)
        dev.extend(abs(r - centre) for r in resid)
    sigma = max(1.4826 * median(dev), cfg.leak_noise_floor_bytes)
    span = 0.5 * (rel[half - 1] - rel[0] + rel[-1] - rel[half])
    if span <= 0:
        return -math.inf
    # Slope of h values spread evenly over span: SE = sigma sqrt(12) / (sqrt(h) span), with
    # one independent value in INDEPENDENT (the two-bucket envelope shares buckets; measured
    # on generated leaks, tests/support/tracegen.py, this gives the statistic unit spread).
    se = sigma * math.sqrt(12.0) / (math.sqrt(half / INDEPENDENT) * span)
    diff = second - ratio * first
    if both:
        diff = min(diff, first - ratio * second)
    return diff / (se * math.sqrt(1.0 + ratio * ratio))


def _without_steps(ys: list[float], cfg: DetectConfig) -> list[float]:
    """``ys`` less its steps: jumps beyond 6 noise units of the typical increment that carry a
    fifth of the whole rise or more (an allocator step under a leak would otherwise make its
    half look faster; a cache's blocks each carry a small share)."""
    diffs = [b - a for a, b in zip(ys, ys[1:], strict=False)]
    if not diffs:
        return ys
    mid = median(diffs)
    sigma = max(1.4826 * median([abs(d - mid) for d in diffs]), cfg.leak_noise_floor_bytes)
    total = abs(ys[-1] - ys[0])
    out = [ys[0]]
    shift = 0.0
    for y, d in zip(ys[1:], diffs, strict=True):
        if abs(d - mid) > 6.0 * sigma and abs(d) > STEP_SHARE * total:
            shift += d - mid
        out.append(y - shift)
    return out


def kept(ts: list[float], ys: list[float], cfg: DetectConfig) -> Values:
    """The values less the blocks freed later (``floor.freed_later``, FREED noise units): a
    block held for a few minutes and freed (a transient) would otherwise count as one large
    step carrying most of a slow staircase's rise (too few steps), and its rise and fall as
    two allocator steps hiding the growth in between (no steadiness)."""
    _drawdown, noise = shape_of(ys, cfg)
    freed = freed_later(ys, FREED * noise, FREED_RUN)
    keep = [i for i, f in enumerate(freed) if not f]
    return [ts[i] for i in keep], [ys[i] for i in keep]


def confirm(
    levels: Sequence[FloorLevel],
    origin: float,
    now: float,
    limit: float | None,
    cfg: DetectConfig,
) -> LeakFinding | None:
    """A leak found on the growth since ``origin`` (the fast path), or None. The baseline and
    the growth are read from one level (a coarser level's minima sit lower on a noisy floor):
    the finest holding enough of both."""
    window = cfg.leak_suspect_window_s
    if now - origin < window:
        return None
    half = 0.5 * min(now - origin, window)
    for level in levels:
        # At least BASELINE_VALUES of this level's buckets before the change point: a growth
        # longer than the finest level holds is judged on a coarser one, whose buckets would
        # otherwise be too few to show the floor before it.
        base_start = origin - max(half, (BASELINE_VALUES + 1) * level.width)
        ts, ys = _after(level, base_start)
        cut = next((i for i, t in enumerate(ts) if t >= origin), len(ts))
        if cut < BASELINE_VALUES or ts[cut - 1] - ts[0] < 0.5 * (origin - base_start):
            continue
        base = ts[:cut], ys[:cut]
        start = _rise_start(base, ts[cut:], ys[cut:], cfg)
        if start is None or now - start < window:
            return None
        i = ts.index(start)
        if len(ts) - i < MIN_VALUES:
            continue
        return _judged(base, ts[i:], ys[i:], now - start, level.width, limit, cfg)
    return None


def _judged(
    base: Values,
    ts: list[float],
    ys: list[float],
    grown: float,
    width: float,
    limit: float | None,
    cfg: DetectConfig,
) -> LeakFinding | None:
    held_t, held_y = kept(ts, ys, cfg)
    if len(held_y) < MIN_VALUES:
        return None
    found, _ = judge(ts, ys, limit, cfg, kept=held_y)
    if found is None:
        return None
    cache = math.exp(-grown / (2 * cfg.leak_cache_tau_s))
    if slowdown_z(held_t, _without_steps(held_y, cfg), cache, cfg, both=True) < SLOWDOWN_Z:
        return None
    if not _flat_before(base, found, width, cfg):
        return None
    return found


def _rise_start(base: Values, ts: list[float], ys: list[float], cfg: DetectConfig) -> float | None:
    """Where the rise began: once the floor stays RUN values above its baseline by 3 noise
    units, the time at which the line through the values since then (Theil-Sen) meets the
    baseline's level. Not the first value above it (noise picks it: a high start hides the
    first half's rise), nor the change point itself when the CUSUM dated it early (a flat
    stretch in front of a filling cache hides how it slows down)."""
    _drawdown, noise = shape_of(base[1], cfg)
    level = median(base[1])
    clear = level + 3.0 * noise
    for i in range(len(ys) - RUN + 1):
        if min(ys[i : i + RUN]) > clear:
            after_t, after_y = ts[i:], ys[i:]
            if len(after_t) < RUN:
                return None
            rate = theil_sen([t - after_t[0] for t in after_t], after_y)
            if rate <= 0:
                return None
            centre = median(
                [y - rate * (t - after_t[0]) for t, y in zip(after_t, after_y, strict=True)]
            )
            meets = after_t[0] - (centre - level) / rate
            return next((t for t in ts if t >= meets), ts[i])
    return None


def _flat_before(base: Values, found: LeakFinding, width: float, cfg: DetectConfig) -> bool:
    """The floor before the growth was flat and no higher than where the growth began: the
    lowest value of each quarter of the baseline is at most 3 noise units (and two buckets'
    growth: the envelope lags a rising floor) above the growth's fitted start (a spike above the floor, an evaluation or a save without phase information,
    leaves a quarter's lowest value alone; the crest of a sawtooth's previous tooth does not),
    and it rose at most BASELINE_SLOPE as fast as the growth."""
    ts, ys = base
    start = found.floor - found.rate * found.window_s  # the growth's fitted line at its start
    drawdown, noise = shape_of(ys, cfg)
    if drawdown > 4.0 * noise:
        return False  # memory released just before: the next tooth of a sawtooth
    q = len(ys) // 4
    tol = 3.0 * noise + 2.0 * width * found.rate
    if max(min(ys[j * q : (j + 1) * q]) for j in range(4)) > start + tol:
        return False  # memory released where the growth began: a sawtooth, not a leak
    slope = theil_sen([t - ts[0] for t in ts], ys)
    return slope <= BASELINE_SLOPE * found.rate


def decelerating(levels: Sequence[FloorLevel], origin: float, cfg: DetectConfig) -> bool:
    """The growth since ``origin`` slows down beyond noise, like a cache filling up."""
    seg = segment(levels, origin)
    if seg is None:
        return False
    ts, ys = seg
    ratio = cfg.leak_saturation_ratio
    # with and without its steps: one allocator step under a leak is no slowing down, a
    # curriculum step that settles is
    return (
        slowdown_z(ts, ys, ratio, cfg) < -SLOWDOWN_Z
        and slowdown_z(ts, _without_steps(ys, cfg), ratio, cfg) < -SLOWDOWN_Z
    )
