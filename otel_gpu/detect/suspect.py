"""The suspicion stage of leak detection: cheap, early, and silent (issue 20 §1).

A one-sided CUSUM (Page's test) on the memory floor's rise above its reference level, one
value per closed bucket of each of the finer levels (``leak.py``). The reference is the median
of the latest ``RECENT`` bucket floors, re-taken whenever the sum is 0 (no evidence), so it
follows the floor while nothing rises and stays put once it does; the noise scale comes from
their successive differences (robust: 1.4826 x MAD / sqrt 2, at least
``leak_noise_floor_bytes``). Each bucket adds (floor - reference) / noise, clipped at ``CLIP``
(one allocator step is one step), less the allowance ``SUSPECT_K``; the sum restarts at 0
whenever it would go below. A floor that rises accumulates evidence quadratically in time
(the increments of a noisy floor would hide a slow rise in their own noise).

A suspicion stands when the sum crosses ``h``, set from the target false-suspicion rate
(``leak_suspect_per_day``) by Siegmund's approximation of the average run length of a CUSUM
on unit-variance values, ARL0 = (exp(2 k b) - 2 k b - 1) / (2 k^2) with b = h + 1.166, taken
with the allowance less 1.5 standard errors of the reference (``REF_ERROR``): an estimated
reference a little low makes a flat floor look risen for as long as it is kept (measured on
Gaussian and uniform noise, tests/test_detect_suspect.py).

The change point (``origin``) is the last bucket before the current run of positive evidence
(Page's estimate of where the rise began). The suspicion ends when the sum falls back to 0,
when the floor stops rising (the latest ``RECENT``/4 floors, all after the origin, no higher
than the ``RECENT``/2 before them: a step that ended, an evaluation spike gone, a cache at its
cap), or when the evidence resets. A block held for at most ``RECENT``/4 buckets and freed
since (``floor.freed_later``) is left out of that comparison: counted, its fall would end the
suspicion of a floor that still rises under it (a 20 MiB staircase with a 155 MB block held
for 5 minutes did). The ``RECENT``/2 before span at least one stair of a staircase whose
stairs are about ``RECENT``/4 buckets long, which the ``RECENT``/4 right before may not.

A suspicion notifies nobody and moves no breaker. It is what starts attribution (the agent
asks the subject's process for a census), it is visible (self-metric, live view, recording),
and while it stands the growth since its change point may confirm a leak early (growth.py).
"""

from __future__ import annotations

import math
from collections import deque

from otel_gpu.detect.floor import freed_later

SUSPECT_K = 0.5  # allowance per bucket, in noise units: the classic half of a 1-sigma shift
CLIP = 10.0  # a bucket counts at most this many noise units
RECENT = 32  # floors kept for the reference level and the noise scale
MIN_HISTORY = 8  # floors seen before the sum starts
FREED = 6.0  # noise units a floor stands above a later one to be a block freed since
REBASE_EVERY = 4  # while nothing rises, the reference is re-taken every this many buckets
# The allowance the threshold is computed with: SUSPECT_K less 1.5 standard errors of a median
# of RECENT values (1.2533 / sqrt n noise units).
REF_ERROR = 1.5 * 1.2533 / math.sqrt(RECENT)


def threshold(per_day: float, bucket_s: float, k: float = SUSPECT_K - REF_ERROR) -> float:
    """The CUSUM threshold ``h`` whose average run length without a leak is one false
    suspicion per ``1 / per_day`` days (Siegmund's approximation, solved by bisection)."""
    arl = 86400.0 / (per_day * bucket_s)  # buckets between false suspicions

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
    """One level's suspicion: ``feed`` each closed bucket's floor; ``since`` is the data time
    the standing suspicion began (None: none stands), ``origin`` where the rise began."""

    __slots__ = (
        "h",
        "noise_floor",
        "score",
        "since",
        "origin",
        "run",
        "idle",
        "ref",
        "sigma",
        "recent",
        "last_t",
    )

    def __init__(self, h: float, noise_floor: float) -> None:
        self.h = h
        self.noise_floor = max(noise_floor, 1.0)
        self.score = 0.0
        self.since: float | None = None
        # The change point: the data time of the last bucket before the current run of positive
        # evidence (Page's estimate of where the rise began); None while the sum is 0.
        self.origin: float | None = None
        self.run = 0  # buckets since the origin
        self.idle = 0  # buckets with the sum at 0 in a row
        self.ref: float | None = None  # the floor's reference level, bytes
        self.sigma = self.noise_floor  # the robust noise of one bucket's floor, bytes
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.last_t = 0.0

    def reset(self) -> None:
        self.score = 0.0
        self.since = None
        self.origin = None
        self.run = 0
        self.ref = None
        self.sigma = self.noise_floor
        self.recent.clear()

    def _rebase(self) -> None:
        """The reference: the median of the latest RECENT floors; the noise: from their
        successive differences (a trend or one step leaves them alone)."""
        values = list(self.recent)
        self.ref = median(values)
        diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
        if diffs:
            mid = median(diffs)
            mad = median([abs(d - mid) for d in diffs])
            self.sigma = max(self.noise_floor, 1.4826 * mad / math.sqrt(2.0))

    def _stopped(self) -> bool:
        """The floor no longer rises: the median of the latest RECENT/4 floors, all after the
        origin, is no higher than that of the RECENT/2 before them (a step that ended, an
        evaluation spike gone, a cache at its cap). A block held for at most RECENT/4 buckets
        and freed since is left out of both (``floor.freed_later``, FREED noise units): the
        floor under it may still rise, and so may the floor while it is held."""
        part = RECENT // 4
        if self.run < part or len(self.recent) < 3 * part:
            return False
        values = list(self.recent)
        freed = freed_later(values, FREED * self.sigma, part)
        latest = [v for v, f in zip(values[-part:], freed[-part:], strict=True) if not f]
        before = [
            v
            for v, f in zip(values[-3 * part : -part], freed[-3 * part : -part], strict=True)
            if not f
        ]
        return bool(latest and before) and median(latest) <= median(before)

    def feed(self, t: float, floor: float) -> bool:
        """Add one closed bucket's floor at data time ``t``; True when a suspicion starts."""
        self.recent.append(floor)
        last_t, self.last_t = self.last_t, t
        if self.ref is None:
            if len(self.recent) >= MIN_HISTORY:
                self._rebase()
            return False
        z = min(CLIP, (floor - self.ref) / self.sigma) - SUSPECT_K
        before = self.score
        # capped, so that a suspicion ends soon once the floor stops rising
        self.score = min(2 * self.h, max(0.0, self.score + z))
        self.run += 1
        if self.score > 0.0 and self._stopped():
            self.score = 0.0
        if self.score <= 0.0:
            self.since = None  # no rise (any more): the suspicion (if any) is over
            self.origin = None
            self.run = 0
            self.idle += 1
            if self.idle % REBASE_EVERY == 1:  # the reference moves slowly: no need each bucket
                self._rebase()
            return False
        self.idle = 0
        if before <= 0.0:
            self.origin = last_t
            self.run = 1
        if self.since is None and self.score >= self.h:
            self.since = t
            return True
        return False


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
