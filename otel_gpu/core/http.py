"""One bounded HTTP server for every endpoint we serve: health probes, ``/stats`` and
Prometheus ``/metrics``, in the agent, the sidecar and the processor.

Bounded under abuse: at most ``max_workers`` connections are served at once, each on a pooled
thread; a connection beyond that is closed at once (and counted in :attr:`refused`), and the
handler's ``timeout`` drops one that stalls, so idle or hostile clients cannot grow threads.
A client that hangs up mid-request costs no traceback.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from otel_gpu.core.addresses import format_hostport, parse_hostport
from otel_gpu.core.errors import UsageError


class BoundedServer(HTTPServer):
    """An HTTPServer handling each connection on a bounded pool; excess connections closed.
    Give the handler a ``timeout`` so that a connection that sends nothing cannot hold its
    thread."""

    request_queue_size = 128  # the listen backlog: a burst of probes is not left to SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_workers: int,
        thread_name: str = "otel-gpu-http",
    ) -> None:
        # Before binding: a bind that fails calls server_close(), which shuts the pool down
        # (the pool starts no thread until a connection comes).
        self._slots = threading.BoundedSemaphore(max_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name)
        self.refused = 0  # connections closed because all slots were taken
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # all workers busy: refuse rather than queue
            return
        try:
            self._pool.submit(self._serve, request, client_address)
        except RuntimeError:  # the pool is shut down: the server is closing
            self._slots.release()
            self.shutdown_request(request)

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


@dataclass(frozen=True)
class Reply:
    """One HTTP answer: status code, body and its content type."""

    code: int
    body: str
    content_type: str = "text/plain"


Route = Callable[[], Reply]


def json_reply(code: int, body: Mapping[str, Any]) -> Reply:
    return Reply(code, json.dumps(body) + "\n", "application/json")


class RouteServer:
    """Serves ``GET`` on ``routes`` (path → reply) from a :class:`BoundedServer` on a thread of
    its own. A route that raises answers 500 with the exception's type only."""

    def __init__(
        self,
        address: str,
        routes: Mapping[str, Route],
        *,
        source: str,
        max_connections: int,
        idle_s: float,
        not_found: Callable[[list[str]], Reply],
        thread_name: str = "otel-gpu-health",
        example: str = "127.0.0.1:8081",
    ) -> None:
        """``source``: the flag or variable ``address`` came from, named in errors; ``idle_s``:
        how long a connection may take to send its request."""
        host, port = parse_hostport(address, source, example=example)
        table = dict(routes)
        known = sorted(table)

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_s

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                route = table.get(self.path.split("?", 1)[0])
                if route is None:
                    reply = not_found(known)
                else:
                    try:
                        reply = route()
                    except Exception as exc:  # a check bug must not kill the server
                        reply = Reply(500, f"route failed: {type(exc).__name__}\n")
                data = reply.body.encode()
                self.send_response(reply.code)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # probes every few seconds would flood the log

        try:
            self._server = BoundedServer((host, port), Handler, max_connections, thread_name)
        except OSError as e:
            raise UsageError(f"{source}={address!r}: cannot listen there ({e.strerror})") from None
        self.port = int(self._server.server_address[1])
        self.address = format_hostport(host, self.port)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=thread_name,
            daemon=True,
        )
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections closed because ``max_connections`` were being served."""
        return self._server.refused

    def close(self, timeout_s: float = 1.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
