"""HTTP health endpoint of the processor (a separate port from OTLP).

``GET /healthz``: 200 ``ok`` while healthy; 503 with the reason when

- the processor is shutting down, or
- it has accepted at least one export request and then none for longer than ``stall_after_s``
  (ingestion stalled: the agents or the collector in front stopped sending), or
- it is degraded (``degraded: <reason>``): the state store or a disk queue cannot be written,
  memory is over its soft limit, a forwarder's sender crashed and is being restarted, or the
  subject cap refused a new subject within the last minute.

Calls refused for a peer over its limit, or for sending no message in time, are named in the
body but leave it 200: the limits are doing their work, and a failed liveness probe would let
whoever sends such calls restart the processor.

Before the first request it answers 200 (``ok: waiting for data``), so a freshly started
processor is not restarted for having no clients yet. ``GET /stats`` returns the counters as
JSON. Nothing secret is ever in either answer.

Bounded under abuse (:mod:`otel_gpu.core.http`): at most ``max_connections`` requests are
served at once, by as many pooled threads, plus one reserved for ``/healthz``; a request
beyond that is closed at once, and a connection that has not sent its whole request within
``_IDLE_S`` is dropped (it is read without holding a thread), so idle or trickling
connections cannot pile up threads or starve the probe.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from otel_gpu.core.http import Reply, RouteServer

_IDLE_S = 2.0  # a connection that has not sent its whole request by then is closed


class HealthServer(RouteServer):
    """Serves /healthz and /stats from ``check() -> (healthy, text)`` and ``stats() -> dict``."""

    def __init__(
        self,
        address: str,
        check: Callable[[], tuple[bool, str]],
        stats: Callable[[], dict[str, Any]],
        max_connections: int = 32,
        *,
        source: str = "--health",
    ) -> None:
        """``source``: the flag or variable ``address`` came from, named in errors."""

        def health() -> Reply:
            ok, text = check()
            return Reply(200 if ok else 503, text + "\n")

        def counters() -> Reply:
            return Reply(200, json.dumps(stats(), sort_keys=True), "application/json")

        super().__init__(
            address,
            {"/healthz": health, "/health": health, "/": health, "/stats": counters},
            source=source,
            max_connections=max_connections,
            idle_s=_IDLE_S,
            not_found=lambda _known: Reply(404, "not found: try /healthz or /stats\n"),
            example="127.0.0.1:4317",
        )
