"""What an inference server's queue says about its GPUs (pure; time is the data's own time).

Three findings, from the GPU snapshot beside the server's normalized state:

* **KV cache filling** — the server's KV-cache utilization rose within the last
  :attr:`ServingConfig.kv_fill_hold_s`. The agent's detectors then see the ``load`` phase, which
  the leak detector leaves out, so memory that grows with the cache is expected growth, not a
  leak (a real leak keeps growing once the cache stops).
* **Serving stall** — requests are waiting while every GPU the pod was given idles (utilization
  below :attr:`ServingConfig.idle_util`) for :attr:`ServingConfig.stall_s`: the server is hung,
  not busy. Serving-fatal (``/readyz`` 503).
* **KV-cache pressure** — requests waiting, the KV cache at or above
  :attr:`ServingConfig.kv_full` and preemptions climbing: the replica is overloaded (a warning;
  scale out or lower the batch size). Not serving-fatal: the replica still serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from otel_gpu.core.settings import Setting, number, resolve
from otel_gpu.detect.model import PHASE_LOAD, STALL, THRESHOLD, Alert
from otel_gpu.inference.engines import ServerState

SERVER_SUBJECT = "server"
STALL_ENV = "OTEL_GPU_READY_STALL"
_KV_STEP = 0.001  # a KV-cache utilization change smaller than this is noise


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Thresholds of the serving findings (seconds of data time, fractions 0..1)."""

    stall_s: float = 60.0  # requests waiting on idle GPUs this long is a stall
    idle_util: float = 0.05  # every GPU below this is idle
    kv_full: float = 0.95  # KV cache at or above this is full
    kv_fill_hold_s: float = 30.0  # "filling" lasts this long after the cache last grew

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ServingConfig:
        """``OTEL_GPU_READY_STALL`` (:data:`DECLARED`) over the defaults; UsageError naming
        the variable on a bad value."""
        values, _origin = resolve(DECLARED, env=environ)
        return cls(**values)


DECLARED = (
    Setting(
        "stall_s", STALL_ENV,
        number(1, 86400, accepted="use a number of seconds from 1 to 86400"),
        "seconds of requests waiting on idle GPUs that make a serving stall", "60",
    ),
)  # fmt: skip


class ServingConditions:
    """Follows one server; ``observe`` after each GPU sweep. Not thread-safe."""

    def __init__(self, config: ServingConfig | None = None) -> None:
        self.config = config if config is not None else ServingConfig()
        self._kv: float | None = None
        self._kv_rose_at: float | None = None
        self._stall_since: float | None = None
        self._stall_alerted = False
        self._preemptions: float | None = None
        self._pressure_alerted = False
        self._now = 0.0

    def phase(self) -> str | None:
        """``load`` while the KV cache is filling (the detectors leave it out), else None."""
        rose = self._kv_rose_at
        if rose is not None and self._now - rose <= self.config.kv_fill_hold_s:
            return PHASE_LOAD
        return None

    def observe(
        self, now: float, gpu_utils: Iterable[float | None], server: ServerState | None
    ) -> tuple[list[Alert], list[Alert]]:
        """(alerts that start now, conditions that hold now) at data time ``now``."""
        self._now = max(self._now, now)
        started: list[Alert] = []
        active: list[Alert] = []
        if server is None:
            self._stall_since = None  # unknown queue: no stall can be claimed
            return started, active
        self._follow_kv(now, server)
        stall = self._stall(now, list(gpu_utils), server)
        if stall is not None:
            active.append(stall)
            if not self._stall_alerted:
                self._stall_alerted = True
                started.append(stall)
        else:
            self._stall_alerted = False
        pressure = self._pressure(now, server)
        if pressure is not None and not self._pressure_alerted:
            self._pressure_alerted = True
            started.append(pressure)
        if not (_waiting(server) and _at_least(server.kv_cache_utilization, self.config.kv_full)):
            self._pressure_alerted = False  # the episode ends when the queue or the cache drains
        return started, active

    def _follow_kv(self, now: float, server: ServerState) -> None:
        kv = server.kv_cache_utilization
        if kv is None:
            return
        # Against the level at the last rise, not the previous scrape: a cache that fills
        # slowly rises less than the step between two scrapes but a lot between rises.
        if self._kv is None or kv < self._kv:
            self._kv = kv
        elif kv >= self._kv + _KV_STEP:
            self._kv, self._kv_rose_at = kv, now

    def _stall(self, now: float, utils: list[float | None], server: ServerState) -> Alert | None:
        known = [u for u in utils if u is not None]
        idle = bool(known) and max(known) < self.config.idle_util
        if not (_waiting(server) and idle):
            self._stall_since = None
            return None
        if self._stall_since is None:
            self._stall_since = now
        held = now - self._stall_since
        if held < self.config.stall_s:
            return None
        return Alert(
            kind=STALL,
            subject=SERVER_SUBJECT,
            time=now,
            severity="critical",
            message=(
                f"stalled: {server.requests_waiting:g} request(s) waiting for {held:.0f} s while "
                f"the GPUs idle (util {max(known):.0%}): the {server.engine} server is hung"
            ),
            window_s=held,
            evidence={"mode": "serving", "since": self._stall_since, "util": max(known)},
        )

    def _pressure(self, now: float, server: ServerState) -> Alert | None:
        before, self._preemptions = self._preemptions, server.preemptions
        climbing = (
            before is not None and server.preemptions is not None and server.preemptions > before
        )
        if not (
            climbing
            and _waiting(server)
            and _at_least(server.kv_cache_utilization, self.config.kv_full)
        ):
            return None
        kv = server.kv_cache_utilization or 0.0
        return Alert(
            kind=THRESHOLD,
            subject=SERVER_SUBJECT,
            time=now,
            severity="warning",
            message=(
                f"KV cache full ({kv:.0%}) with {server.requests_waiting:g} request(s) waiting "
                f"and preemptions climbing ({server.preemptions:g}): the replica is overloaded"
            ),
            evidence={"rule": "kv_cache", "value": kv, "limit": self.config.kv_full},
        )


def _waiting(server: ServerState) -> bool:
    return (server.requests_waiting or 0.0) > 0


def _at_least(value: float | None, limit: float) -> bool:
    return value is not None and value >= limit
