"""HTTP health endpoint of the processor (a separate port from OTLP).

``GET /healthz``: 200 ``ok`` while healthy; 503 with the reason when

- the processor is shutting down, or
- it has accepted at least one export request and then none for longer than ``stall_after_s``
  (ingestion stalled: the agents or the collector in front stopped sending).

Before the first request it answers 200 (``ok: waiting for data``), so a freshly started
processor is not restarted for having no clients yet. ``GET /stats`` returns the counters as
JSON. Nothing secret is ever in either answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from otel_gpu.errors import UsageError
from otel_gpu.processor.config import format_hostport, parse_hostport


class HealthServer:
    """Serves /healthz and /stats from ``check() -> (healthy, text)`` and ``stats() -> dict``."""

    def __init__(
        self,
        address: str,
        check: Callable[[], tuple[bool, str]],
        stats: Callable[[], dict[str, Any]],
    ) -> None:
        host, port = parse_hostport(address, "--health")

        class Handler(BaseHTTPRequestHandler):
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
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise UsageError(f"--health {address}: cannot listen there ({e.strerror})") from None
        self._server.daemon_threads = True
        self.address = format_hostport(host, self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otel-gpu-health", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
