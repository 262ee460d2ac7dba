"""The agent's health endpoint (``--health HOST:PORT`` on ``run``, ``watch`` and ``sidecar``).

``GET /healthz`` answers 200 while sampling is fresh and exports succeed, 503 when the last
snapshot is stale (a sweep that cannot finish, a sampler that keeps crashing) or when exports
have failed for longer than ``OTEL_GPU_HEALTH_EXPORT_GRACE`` seconds. The body is one line of
JSON with the reason. The check reads counters only (never NVML or /proc), and the server is
bounded: at most :data:`MAX_WORKERS` requests are served at once (plus one worker reserved for
the probe paths), each connection gets :data:`CONNECTION_TIMEOUT_S` to send its whole request
(read without holding a worker), and requests beyond that are closed at once, so idle, trickling
or hostile clients cannot grow threads or hold a probe off (:mod:`otel_gpu.core.http`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from otel_gpu.agent.selfmetrics import ExportHealth, SamplingState
from otel_gpu.core.http import Reply, Route, RouteServer, json_reply

if TYPE_CHECKING:
    from otel_gpu.agent.agent import Agent
    from otel_gpu.agent.settings import Settings

MAX_WORKERS = 4
CONNECTION_TIMEOUT_S = 1.0  # to send the whole request: a probe needs far less

Check = Callable[[], tuple[bool, str]]


def agent_check(sampling: SamplingState, exports: ExportHealth, export_grace_s: float) -> Check:
    """The ``/healthz`` verdict of an agent: (healthy, one-line reason)."""

    def check() -> tuple[bool, str]:
        age = sampling.age()
        snap = sampling.latest
        if snap is None:
            if age > sampling.stale_after_s:
                return False, f"no snapshot since start {age:.0f} s ago"
            return True, "starting: no snapshot yet"
        if age > sampling.stale_after_s:
            # A restarting sampler publishes its GPUs as unreadable: say why, still 503.
            why = f": {snap.no_gpu_reason}" if snap.no_gpu_reason else ""
            return False, f"sampling stale: last sample {age:.0f} s ago{why}"
        if snap.no_gpu_reason and not snap.gpus:
            reason = f"sampling fresh ({age:.1f} s), no GPU data: {snap.no_gpu_reason}"
        else:
            reason = f"sampling fresh ({age:.1f} s)"
        failing = exports.failing_for()
        if failing > export_grace_s:
            return False, f"exports failing for {failing:.0f} s ({exports.failures} failed)"
        if failing > 0:
            return True, f"{reason}; exports failing for {failing:.0f} s"
        return True, reason

    return check


class LateCheck:
    """A check that is set once the thing it reports on exists (the endpoint is bound before
    the job starts, so a bad address is refused before anything runs)."""

    def __init__(self, before: str = "starting: agent not started yet") -> None:
        self.check: Check | None = None
        self._before = before

    def __call__(self) -> tuple[bool, str]:
        check = self.check
        return (True, self._before) if check is None else check()


def _json(check: Check) -> Route:
    def route() -> Reply:
        ok, reason = check()
        return json_reply(200 if ok else 503, {"ok": ok, "reason": reason})

    return route


def _not_found(known: list[str]) -> Reply:
    return json_reply(404, {"ok": False, "reason": f"not found: try {', '.join(known)}"})


class HealthServer(RouteServer):
    """Serves ``routes`` (path → check) as 200/503 with a one-line JSON body."""

    def __init__(self, address: str, routes: Mapping[str, Check], flag: str = "--health") -> None:
        super().__init__(
            address,
            {path: _json(check) for path, check in routes.items()},
            source=flag,
            max_connections=MAX_WORKERS,
            idle_s=CONNECTION_TIMEOUT_S,
            not_found=_not_found,
        )


class AgentEndpoints:
    """The self-observability around an agent a session builds: the export outcome counter
    (passed to the meter provider and the agent) and the optional ``/healthz`` server, bound
    before the job starts so a bad ``--health`` address is refused before anything runs."""

    def __init__(self, settings: Settings, extra_routes: Mapping[str, Check] | None = None) -> None:
        """``extra_routes``: more path → check pairs (the sidecar's ``/readyz``)."""
        self.settings = settings
        self.export_health = ExportHealth()
        self._check = LateCheck()
        routes: dict[str, Check] = {"/healthz": self._check, **(extra_routes or {})}
        self.server = HealthServer(settings.health, routes) if settings.health else None

    def attach(self, agent: Agent) -> None:
        """``/healthz`` reports on ``agent`` from now on."""
        self._check.check = agent_check(
            agent.sampler, self.export_health, self.settings.health_export_grace_s
        )

    def agent_failed(self, reason: str) -> None:
        """``/healthz`` is 503 from now on, saying why no agent runs."""
        self._check.check = lambda: (False, f"agent not running: {reason}")

    def close(self, timeout_s: float = 1.0) -> None:
        if self.server is not None:
            self.server.close(timeout_s)
