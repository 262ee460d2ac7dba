"""Snapshot series made by hand for the engine, the breaker and the watchdog."""

from __future__ import annotations

from collections.abc import Callable

from otel_gpu.sampling.snapshot import GpuSample, Snapshot

GB = 1e9
STEP = 60.0  # s between points


def leak_snapshots(start: float, hours: float, rate: Callable[[float], float]):
    """A GPU whose memory is flat for an hour, then rises at ``rate(t)`` By/s."""
    used = 20 * GB
    t = start
    while t <= start + hours * 3600:
        if t > start + 3600:
            used += rate(t) * STEP
        gpu = GpuSample(
            uuid="GPU-live",
            index=0,
            memory_used=int(used),
            memory_total=int(80 * GB),
            util_gpu=0.9,
            power_w=600.0,
            power_limit_w=700.0,
            processes_listed=False,  # process count unknown (0 would mean "released")
        )
        yield Snapshot(time=t, gpus=(gpu,))
        t += STEP
