"""HTTP health endpoint of the processor (a separate port from OTLP).

``GET /healthz``: 200 ``ok`` while healthy; 503 with the reason when

- the processor is shutting down, or
- it has accepted at least one export request and then none for longer than ``stall_after_s``
  (ingestion stalled: the agents or the collector in front stopped sending).

Before the first request it answers 200 (``ok: waiting for data``), so a freshly started
processor is not restarted for having no clients yet. ``GET /stats`` returns the counters as
JSON. Nothing secret is ever in either answer.

Bounded under abuse: at most ``max_connections`` connections are served at once, by as many
pooled threads at most; a connection beyond that is closed at once, and one that sends nothing
is dropped after ``_IDLE_S``, so idle connections cannot pile up threads.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from otel_gpu.errors import UsageError
from otel_gpu.processor.config import format_hostport, parse_hostport

_IDLE_S = 2.0  # a connection that has not sent its request by then is closed


class _BoundedServer(HTTPServer):
    """An HTTPServer handling each connection on a bounded pool; excess connections closed."""

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        # Before binding: a bind that fails calls server_close(), which shuts the pool down
        # (the pool starts no thread until a connection comes).
        self._slots = threading.BoundedSemaphore(max_connections)
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="otel-gpu-health")
        self.refused = 0  # connections closed because all slots were taken
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or timed out is not worth a traceback

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class HealthServer:
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
        host, port = parse_hostport(address, source)

        class Handler(BaseHTTPRequestHandler):
            timeout = _IDLE_S  # socket timeout: idle or slow clients are dropped

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path in ("/healthz", "/health", "/"):
                    ok, text = check()
                    self._reply(200 if ok else 503, "text/plain", text + "\n")
                elif path == "/stats":
                    self._reply(200, "application/json", json.dumps(stats(), sort_keys=True))
                else:
                    self._reply(404, "text/plain", "not found: try /healthz or /stats\n")

            def _reply(self, code: int, ctype: str, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # probes every few seconds would flood the log

        try:
            self._server = _BoundedServer((host, port), Handler, max_connections)
        except OSError as e:
            raise UsageError(f"{source}={address!r}: cannot listen there ({e.strerror})") from None
        self.address = format_hostport(host, self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otel-gpu-health", daemon=True
        )
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections closed because ``max_connections`` were being served."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
