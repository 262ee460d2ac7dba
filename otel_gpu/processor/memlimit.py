"""Refuse export requests while the processor's memory is near its limit (the Collector's
memory_limiter, in bytes of resident memory).

Above the soft limit (80 % of the hard limit, the Collector's default spike allowance) every
export request is refused with RESOURCE_EXHAUSTED and a RetryInfo delay: the exporters in front
keep their data and retry, nothing accepted is lost. Above the soft limit the limiter also asks
the allocator to give memory back (a garbage collection, then glibc's ``malloc_trim``, at most
once a second), since CPython would otherwise keep freed arenas and look full after a spike.
The reading comes from :meth:`MemoryLimiter.check`, called on the processor's own ticker,
never on a request thread; the reader and the clock are injected for tests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time
from collections.abc import Callable

SOFT_FRACTION = 0.8
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (0 when /proc cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def release_memory() -> None:
    """Collect garbage, then hand freed heap pages back to the OS (glibc's malloc_trim)."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the garbage collection alone has to do


class MemoryLimiter:
    """``limited`` is True while resident memory is above the soft limit."""

    def __init__(
        self,
        limit_bytes: int,
        read: Callable[[], int] = rss_bytes,
        release: Callable[[], None] = release_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hard = limit_bytes
        self.soft = int(limit_bytes * SOFT_FRACTION)
        self._read = read
        self._release = release
        self._clock = clock
        self._released_at = -1e9
        self.limited = False
        self.rss = 0
        self.episodes = 0  # times the soft limit was crossed upwards

    def check(self) -> bool:
        """Read memory now; returns ``limited``."""
        if self.hard <= 0:
            return False
        rss = self._read()
        if rss > self.soft and self._clock() - self._released_at >= 1.0:
            self._released_at = self._clock()
            self._release()
            rss = self._read()
        self.rss = rss
        was, self.limited = self.limited, rss > self.soft
        if self.limited and not was:
            self.episodes += 1
        return self.limited

    def snapshot(self) -> dict[str, int | bool]:
        """The readings, for /stats and self-telemetry."""
        return {"rss_bytes": self.rss, "soft_limit_bytes": self.soft, "limited": self.limited}

    def problem(self) -> str | None:
        """Why health is degraded by memory, if it is."""
        if not self.limited:
            return None
        return (
            f"memory {self.rss / 2**20:.0f} MiB above the soft limit "
            f"{self.soft / 2**20:.0f} MiB; refusing exports with a retry delay"
        )
