"""Adaptive sampling: the agent keeps within a CPU budget by reading the least critical things
less often (``OTEL_GPU_CPU_BUDGET``, percent of one core).

Pure decision logic with an injected clock; the sampling helper feeds it the agent's CPU time
(wrapper and helper together) and how busy the host's CPUs are, and applies what it decides.

Each window (``window_s``) the agent's cost is compared with the budget. Over it, or with the
host's CPUs saturated (``HOST_BUSY`` of them busy: the job needs every cycle), the controller
backs off one level (the host's saturation counts once the agent uses at least
``release_ratio`` of its budget); the levels slow the least critical reads first:

1. per-process ``/proc`` details (CPU, memory, threads, files of the watched tree);
2. then per-process GPU utilization (NVML's process samples).

GPU readings and the GPU process list (GPU memory per process: what a leak detector judges)
are never slowed. Hysteresis: a level is given back only after ``calm_windows`` windows in a
row under ``release_ratio`` of the budget with the host not saturated, so it does not flap.
While a detector suspects or has confirmed a leak or stall (``protected``), nothing is slowed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

CLK_TCK = os.sysconf("SC_CLK_TCK")

PROCESS_DETAILS = "process_details"
PROCESS_GPU_UTIL = "process_gpu_util"
READS = (PROCESS_DETAILS, PROCESS_GPU_UTIL)
# Sweeps per read at each level (1: every sweep); level 0 reads everything every sweep.
LEVELS: tuple[dict[str, int], ...] = (
    {},
    {PROCESS_DETAILS: 4},
    {PROCESS_DETAILS: 4, PROCESS_GPU_UTIL: 4},
)
HOST_BUSY = 0.95  # fraction of the host's CPU time busy over a window: saturated


class BudgetController:
    """Decides, once per window, how many sweeps apart each kind of read happens."""

    def __init__(
        self,
        budget_pct: float,
        *,
        window_s: float = 10.0,
        release_ratio: float = 0.5,
        calm_windows: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``budget_pct``: percent of one core; 0 turns adaptive sampling off."""
        self.budget_pct = budget_pct
        self.window_s = window_s
        self.release_ratio = release_ratio
        self.calm_windows = calm_windows
        self._clock = clock
        self.level = 0
        self.protected = False
        self.last_cost_pct: float | None = None
        self._start: tuple[float, float] | None = None  # (time, agent CPU s) of the window
        self._calm = 0

    def observe(
        self,
        agent_cpu_s: Callable[[], float],
        host_busy: Callable[[], float | None] = lambda: None,
    ) -> None:
        """Called after each sweep; at the start and end of each window it asks for the
        agent's total CPU seconds so far and the host's busy fraction since the last ask
        (None: unknown), and decides at the end."""
        now = self._clock()
        if self.budget_pct <= 0:
            return
        if self._start is None:
            self._start = (now, agent_cpu_s())
            host_busy()
            return
        began, cpu0 = self._start
        if now - began < self.window_s:
            return
        cpu = agent_cpu_s()
        busy = host_busy()
        self._start = (now, cpu)
        cost = 100.0 * max(0.0, cpu - cpu0) / (now - began)
        self.last_cost_pct = cost
        # A saturated host counts once the agent's own share is noticeable (a tiny agent slowing
        # down frees nothing for the job).
        saturated = (
            busy is not None and busy >= HOST_BUSY and cost >= self.release_ratio * self.budget_pct
        )
        if cost > self.budget_pct or saturated:
            self._calm = 0
            self.level = min(self.level + 1, len(LEVELS) - 1)
        elif cost < self.release_ratio * self.budget_pct:
            self._calm += 1
            if self._calm >= self.calm_windows and self.level > 0:
                self.level -= 1
                self._calm = 0
        else:
            self._calm = 0

    def every(self, read: str) -> int:
        """Sweeps between two reads of ``read`` now (1: every sweep)."""
        if self.protected:
            return 1
        return LEVELS[self.level].get(read, 1)

    def intervals(self, interval_s: float) -> tuple[tuple[str, float], ...]:
        """The effective seconds between reads of each kind (``gpu`` is never slowed)."""
        return (("gpu", interval_s), *((r, interval_s * self.every(r)) for r in READS))


def agent_cpu_seconds(parent_pid: int, proc_root: str = "/proc") -> float:
    """CPU seconds of this process plus its parent's (the agent: helper and wrapper)."""
    t = os.times()
    total = t.user + t.system
    if parent_pid:
        try:
            with open(f"{proc_root}/{parent_pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, ValueError, IndexError):
            pass
    return total


class HostCpu:
    """The host's busy fraction between two reads of ``/proc/stat`` (its first line)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._path = f"{proc_root}/stat"
        self._last: tuple[int, int] | None = None

    def busy(self) -> float | None:
        try:
            with open(self._path, "rb") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])
        last, self._last = self._last, (total, idle)
        if last is None or total <= last[0]:
            return None
        return 1.0 - (idle - last[1]) / (total - last[0])
