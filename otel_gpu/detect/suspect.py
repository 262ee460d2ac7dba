"""The suspicion stage of leak detection: cheap, early, and silent (issue 20 §1).

A one-sided CUSUM (Page's test) on the increments of the memory floor, one value per closed
finest bucket (``leak_bucket_s``). Each increment is standardised by a robust noise scale
(1.4826 x the median absolute deviation of the recent increments, at least
``leak_noise_floor_bytes``), clipped at ``CLIP`` (one allocator step is one step, not a
trend), and reduced by the allowance ``SUSPECT_K`` (and at least the slowest rate worth an
alert); the sum restarts at 0 whenever it would go below. A suspicion stands when the sum
crosses ``h``, which is set from the target false-suspicion rate
(``leak_suspect_per_day``) by Siegmund's approximation of the average run length of a CUSUM
on unit-variance increments: ARL0 = (exp(2 k b) - 2 k b - 1) / (2 k^2) with b = h + 1.166.

A suspicion notifies nobody and moves no breaker. It is what starts attribution (the agent
asks the subject's process for a census), it is visible (self-metric, live view, recording),
and while it stands the trend tests of ``leak.py`` may confirm from a shorter window
(``leak_suspect_window_s``): two independent pieces of evidence, the early one cheap.
It ends when the sum falls back to 0 (the floor stopped rising) or the evidence resets.
"""

from __future__ import annotations

import math
from collections import deque

SUSPECT_K = 0.5  # allowance per increment, in noise units: the classic half of a 1-sigma shift
CLIP = 10.0  # an increment counts at most this many noise units
HISTORY = 64  # increments kept for the noise scale
MIN_HISTORY = 8  # increments seen before a suspicion can stand


def threshold(per_day: float, bucket_s: float, k: float = SUSPECT_K) -> float:
    """The CUSUM threshold ``h`` whose average run length without a leak is one false
    suspicion per ``1 / per_day`` days (Siegmund's approximation, solved by bisection)."""
    arl = 86400.0 / (per_day * bucket_s)  # increments between false suspicions

    def run_length(h: float) -> float:
        b = 2 * k * (h + 1.166)
        return (math.exp(b) - b - 1) / (2 * k * k)

    low, high = 0.0, 100.0
    for _ in range(80):
        mid = 0.5 * (low + high)
        if run_length(mid) < arl:
            low = mid
        else:
            high = mid
    return high


class Cusum:
    """One subject's suspicion: ``feed`` each closed bucket's floor; ``since`` is the data
    time the standing suspicion began (None: none stands)."""

    __slots__ = ("h", "allowance", "noise_floor", "score", "since", "last", "increments", "peak")

    def __init__(self, h: float, noise_floor: float, min_increment: float) -> None:
        self.h = h
        self.noise_floor = max(noise_floor, 1.0)
        self.allowance = min_increment  # bytes per bucket: growth slower than this is no leak
        self.score = 0.0
        self.since: float | None = None
        self.last: float | None = None
        self.increments: deque[float] = deque(maxlen=HISTORY)
        self.peak = 0.0

    def reset(self) -> None:
        self.score = 0.0
        self.since = None
        self.last = None
        self.increments.clear()

    def scale(self) -> float:
        """The robust noise of an increment, bytes."""
        if not self.increments:
            return self.noise_floor
        s = sorted(self.increments)
        mid = s[len(s) // 2]
        mad = sorted(abs(x - mid) for x in s)[len(s) // 2]
        return max(self.noise_floor, 1.4826 * mad)

    def feed(self, t: float, floor: float) -> bool:
        """Add one closed bucket's floor at data time ``t``; True when a suspicion starts."""
        last, self.last = self.last, floor
        if last is None:
            return False
        d = floor - last
        sigma = self.scale()
        self.increments.append(d)
        z = min(CLIP, (d - self.allowance) / sigma) - SUSPECT_K
        # capped, so that a leak that stops ends its suspicion within ~2 h / k buckets
        self.score = min(2 * self.h, max(0.0, self.score + z))
        if self.score <= 0.0:
            self.since = None  # the floor stopped rising: the suspicion (if any) is over
            return False
        if self.since is None and self.score >= self.h and len(self.increments) >= MIN_HISTORY:
            self.since = t
            return True
        return False
