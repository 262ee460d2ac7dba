"""The agent's health endpoint (``--health HOST:PORT`` on ``run`` and ``watch``).

``GET /healthz`` answers 200 while sampling is fresh and exports succeed, 503 when the last
snapshot is stale (a sweep that cannot finish, a sampler that keeps crashing) or when exports
have failed for longer than ``OTEL_GPU_HEALTH_EXPORT_GRACE`` seconds. The body is one line of
JSON with the reason. The check reads counters only (never NVML or /proc), and the server is
bounded: at most :data:`MAX_WORKERS` requests are served at once, each connection gets
:data:`CONNECTION_TIMEOUT_S` to send its request, and connections beyond that are closed at once,
so idle or hostile clients cannot grow threads or block a probe for long.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from otel_gpu.config import check_hostport
from otel_gpu.errors import UsageError
from otel_gpu.selfmetrics import ExportHealth, SamplingState

MAX_WORKERS = 4
CONNECTION_TIMEOUT_S = 1.0  # to send the request line and headers: a probe needs far less

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


class BoundedServer(ThreadingHTTPServer):
    """An HTTP server with at most ``max_workers`` connections served at once (a thread each);
    one beyond that is closed at once. Give the handler a ``timeout`` so that a connection that
    sends nothing cannot hold its thread. Also serves the agent's ``/metrics``."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the listen backlog: a burst of probes is not left to SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_workers: int = MAX_WORKERS,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_workers)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # all workers busy: refuse rather than queue
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HealthServer:
    """Serves ``routes`` (path → check) as 200/503 with a one-line JSON body."""

    def __init__(self, address: str, routes: Mapping[str, Check], flag: str = "--health") -> None:
        host, port = check_hostport(address, flag)
        table = dict(routes)

        class Handler(BaseHTTPRequestHandler):
            timeout = CONNECTION_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                check = table.get(self.path.split("?", 1)[0])
                if check is None:
                    known = ", ".join(sorted(table))
                    self._reply(404, {"ok": False, "reason": f"not found: try {known}"})
                    return
                try:
                    ok, reason = check()
                except Exception as exc:  # a check bug must not kill the server
                    ok, reason = False, f"health check failed: {type(exc).__name__}"
                self._reply(200 if ok else 503, {"ok": ok, "reason": reason})

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = (json.dumps(body) + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # probes every few seconds would flood the log

        try:
            self._server = BoundedServer((host, port), Handler)
        except OSError as e:
            raise UsageError(f"{flag} {address}: cannot listen there ({e.strerror})") from None
        bound = self._server.server_address
        self.port = int(bound[1])
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="otel-gpu-health",
            daemon=True,
        )
        self._thread.start()

    def close(self, timeout_s: float = 1.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
