"""Held-out synthetic traces for the leak detector: drawn at random from wide ranges, so a score
on them says how the engine does on jobs it was not tuned on (``benchmarks/score_synthetic.py``).

``scenario(kind, seed)`` returns a ``tracegen.Trace``. Every trace draws its own sampling interval
(1-60 s), memory limit, load time, noise (NVML-like: 2 MiB quantized; in-process: per-sample
jitter of 20 MB to 0.6 GB), whether phases are reported, and background patterns any job may
show: evaluation spikes, a GC sawtooth, checkpoint saves (memory staged while the GPU idles).

Kinds (``LEAKS`` and ``BENIGN``):

* ``leak``: a steady leak of 30-3000 MB/h (log-uniform) from a random onset, continuous or in
  chunks (one tensor kept every few steps), over any of the background patterns, sometimes
  with allocator steps under it;
* ``curriculum``: 2-5 step-ups of 0.5-8 GB (sequence length raised), each settling in minutes;
* ``cache``: a cache filling toward a cap of 0.5-30 GB with a time constant of 5-60 min,
  starting after load or later (inference traffic arriving);
* ``kvcache``: a KV cache growing in blocks of 64 MiB-1 GiB toward a cap, its block rate
  falling as it fills (time constant 5-60 min);
* ``sawtooth``: a GC or evaluation sawtooth (period 5-90 min, 0.2-4 GB) and nothing else;
* ``longsave``: checkpoint saves of 3-25 min every 0.5-3 h that stage 0.5-4 GB while the GPU
  idles, marked as a save phase only when phases are reported;
* ``fragmentation``: 3-8 allocator fragmentation steps of 20-400 MB at random times;
* ``warmup``: a ramp of 1-8 GB after load with a time constant of 2-25 min.

A growth that stays linear for as long as the detector looks is a leak by every observable
measure, so the benign growths here all show their cap (a decelerating fill or steps) within an
hour. Deterministic for a given (kind, seed); pure.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from otel_gpu.detect.model import Point, point
from support.tracegen import COLUMNS_FULL, Trace

GB = 1e9
MIB = float(1 << 20)
LEAKS = ("leak",)
BENIGN = (
    "curriculum",
    "cache",
    "kvcache",
    "sawtooth",
    "longsave",
    "fragmentation",
    "warmup",
)
NO_PHASE = tuple(c for c in COLUMNS_FULL if c != "phase")
INTERVALS = (1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0)

Mem = Callable[[float], float]


def _zero(t: float) -> float:
    return 0.0


def scenario(kind: str, seed: int) -> Trace:
    """One held-out trace of ``kind`` (one of LEAKS + BENIGN)."""
    if kind not in LEAKS + BENIGN:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(LEAKS + BENIGN)}")
    rng = random.Random(f"heldout/{kind}/{seed}")
    interval = rng.choice(INTERVALS)
    duration = rng.uniform(8, 12) * 3600
    limit = rng.choice((24 * 1024**3, 80 * 1024**3, 141e9, 151397597184.0))
    base = rng.uniform(0.2, 0.55) * limit
    load_s = rng.uniform(60, 900)
    nvml = rng.random() < 0.5
    jitter = 0.0 if nvml else math.exp(rng.uniform(math.log(0.02), math.log(0.6))) * GB
    phases = rng.random() < 0.6
    columns = COLUMNS_FULL if phases else NO_PHASE
    idle_w = rng.uniform(60, 90)

    # Background any job may show.
    eval_period = rng.uniform(0.5, 3) * 3600 if rng.random() < 0.6 else math.inf
    eval_len = rng.uniform(120, 600)
    eval_extra = rng.uniform(0.3, 3) * GB
    saw: Mem = _zero
    background = rng.random() < 0.3
    if background:
        saw = _sawtooth(rng, load_s)
    save_period = rng.uniform(0.5, 3) * 3600 if rng.random() < 0.3 else math.inf
    save_len = rng.uniform(120, 900)
    save_extra = rng.uniform(0, 2) * GB

    label, onset, rate = "benign", None, None
    notes = {
        "interval_s": interval,
        "jitter_bytes": jitter,
        "phases": float(phases),
        "sawtooth": float(background),
        "eval_period_s": eval_period,
        "save_period_s": save_period,
    }
    growth: Mem = _zero
    if kind == "leak":
        label = "leak"
        rate = math.exp(rng.uniform(math.log(30), math.log(3000))) * 1e6 / 3600
        onset = rng.uniform(load_s + 600, 0.45 * duration)
        chunk = rng.choice((0.0, 0.0, 2 * MIB, 16 * MIB, 64 * MIB))
        leak = _leak(rate, onset, chunk)
        steps = _steps(rng, load_s, duration, rng.randint(0, 4), 20e6, 300e6)
        growth = lambda t: leak(t) + steps(t)  # noqa: E731
        duration = max(duration, onset + 6 * 3600)
    elif kind == "curriculum":
        growth = _curriculum(rng, load_s, duration)
    elif kind in ("cache", "kvcache"):
        start = load_s if rng.random() < 0.5 else rng.uniform(load_s, 0.6 * duration)
        room = 0.9 * limit - base - max(eval_extra, save_extra)
        if kind == "cache":
            cap, block = min(rng.uniform(0.5, 30) * GB, room), 0.0
        else:
            cap = min(rng.uniform(0.15, 0.35) * limit, room)
            block = rng.choice((64 * MIB, 256 * MIB, 512 * MIB, 1024 * MIB))
        tau = rng.uniform(300, 3600)
        growth = _fill(cap, tau, start, block)
        notes.update(cap_bytes=cap, tau_s=tau, start_s=start)
    elif kind == "sawtooth":
        saw = _sawtooth(rng, load_s)
    elif kind == "longsave":
        save_period = rng.uniform(0.5, 3) * 3600
        save_len = rng.uniform(180, 1500)
        save_extra = rng.uniform(0.5, 4) * GB
    elif kind == "fragmentation":
        growth = _steps(rng, load_s, duration, rng.randint(3, 8), 20e6, 400e6)
    elif kind == "warmup":
        growth = _fill(rng.uniform(1, 8) * GB, rng.uniform(120, 1500), load_s, 0.0)

    points: list[Point] = []
    t = 0.0
    while t <= duration:
        phase: str | None = "train"
        util = min(1.0, max(0.0, rng.gauss(0.9, 0.05)))
        if t < load_s:
            used = base * min(1.0, t / load_s)
            phase, util = "load", rng.uniform(0, 0.05)
        else:
            used = base + growth(t) + saw(t)
            since = t - load_s
            if since % save_period > save_period - save_len:
                phase, util = "save", rng.uniform(0, 0.03)
                used += save_extra
            elif since > eval_len and since % eval_period < eval_len:
                phase, util = "evaluate", util * 0.6
                used += eval_extra
            if jitter:
                used += rng.uniform(0, jitter)
        used = min(math.floor(used / (2 * MIB)) * 2 * MIB, limit)  # NVML's 2 MiB steps
        power = idle_w + (700 * 0.85 - idle_w) * util
        values: dict[str, object] = {
            "used_bytes": float(used),
            "limit_bytes": float(limit),
            "util": round(util, 3),
            "procs": 1,
            "power_w": round(power, 1),
            "power_limit_w": 700.0,
        }
        if phases:
            values["phase"] = phase
        points.append(point(t, values))
        t += interval
    name = f"{kind}_{'nvml' if nvml else 'inproc'}_{interval:g}s_{seed}"
    return Trace(name, label, onset, points, rate_bytes_per_s=rate, columns=columns, notes=notes)


def _leak(rate: float, onset: float, chunk: float) -> Mem:
    def mem(t: float) -> float:
        grown = max(0.0, t - onset) * rate
        return math.floor(grown / chunk) * chunk if chunk else grown

    return mem


def _steps(rng: random.Random, start: float, end: float, n: int, low: float, high: float) -> Mem:
    at = sorted(rng.uniform(start, end) for _ in range(n))
    sizes = [rng.uniform(low, high) for _ in at]
    return lambda t: sum(s for a, s in zip(at, sizes, strict=True) if t >= a)


def _curriculum(rng: random.Random, start: float, end: float) -> Mem:
    n = rng.randint(2, 5)
    at = sorted(rng.uniform(start + 600, 0.85 * end) for _ in range(n))
    sizes = [rng.uniform(0.5, 8) * GB for _ in at]
    settle = [(rng.uniform(0, 0.3), rng.uniform(60, 600)) for _ in at]

    def mem(t: float) -> float:
        total = 0.0
        for a, s, (share, tau) in zip(at, sizes, settle, strict=True):
            if t >= a:
                total += s * (1 - share * math.exp(-(t - a) / tau))
        return total

    return mem


def _fill(cap: float, tau: float, start: float, block: float) -> Mem:
    def mem(t: float) -> float:
        x = cap * (1 - math.exp(-max(0.0, t - start) / tau))
        return math.floor(x / block) * block if block else x

    return mem


def _sawtooth(rng: random.Random, start: float) -> Mem:
    period = rng.uniform(300, 5400)
    amount = rng.uniform(0.2, 4) * GB
    return lambda t: amount * ((max(0.0, t - start) % period) / period)
