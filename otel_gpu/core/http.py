"""One bounded HTTP server for every endpoint we serve: health probes, ``/stats`` and
Prometheus ``/metrics``, in the agent, the sidecar and the processor.

Bounded under abuse, and probes cannot be starved:

- A connection's request head (request line and headers) is read by one reader thread for
  all connections, without blocking, under a deadline for the **whole** request
  (``request_s``), not per ``recv``: a client trickling one byte at a time is closed at the
  deadline, and while it trickles it holds no worker. At most :data:`PENDING_MAX` connections
  wait for their head; beyond that the oldest waiting one is closed, so a flood of
  connections cannot keep a probe that sends its request at once from being read.
- Only a complete request takes a worker: at most ``max_workers`` are served at once on a
  pooled thread, plus :data:`PROBE_WORKERS` reserved for the probe paths (:data:`PROBE_PATHS`)
  that the server was given, so scrapers or slow ``/stats`` readers holding every worker
  cannot make the kubelet's ``/healthz`` or ``/readyz`` fail. A request with no worker free
  is closed at once (counted in :attr:`BoundedServer.refused`).
- The rest of the request (a body) is read under the same deadline, and each write under the
  handler's ``timeout``.

A client that hangs up mid-request costs no traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from otel_gpu.core.addresses import format_hostport, parse_hostport
from otel_gpu.core.errors import UsageError

PROBE_PATHS = frozenset({"/healthz", "/health", "/readyz", "/livez", "/"})
PROBE_WORKERS = 1  # reserved for probe paths, beyond max_workers
PENDING_MAX = 256  # connections waiting for their request head; the oldest is closed beyond
HEAD_MAX = 16 * 1024  # bytes of request line and headers; a longer head is closed
_READ = 4096


@dataclass
class _Pending:
    """A connection whose request head is still being read."""

    sock: socket.socket
    address: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class _DeadlineReader(io.RawIOBase):
    """The bytes read with the head first, then the socket, each read under the request's
    deadline (never later)."""

    def __init__(self, sock: socket.socket, prefix: bytes, deadline: float) -> None:
        self._sock, self._prefix, self._deadline = sock, memoryview(prefix), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._prefix:
            n = min(len(buffer), len(self._prefix))
            buffer[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Connection:
    """The accepted socket as the handler sees it: ``makefile('rb')`` yields the head already
    read, then the socket under the request deadline; everything else is the socket's."""

    def __init__(self, sock: socket.socket, head: bytes, deadline: float, write_s: float) -> None:
        self._sock, self._head, self._deadline = sock, head, deadline
        self._write_s = write_s

    def settimeout(self, value: float | None) -> None:
        if value is not None:
            self._write_s = value  # the handler's timeout: for writes; reads have the deadline

    def makefile(self, mode: str = "r", buffering: int = -1, **_kw: Any) -> Any:
        if "r" in mode:
            raw = _DeadlineReader(self._sock, self._head, self._deadline)
            return io.BufferedReader(raw, buffering if buffering > 0 else io.DEFAULT_BUFFER_SIZE)
        self._sock.settimeout(self._write_s)
        return self._sock.makefile(mode, buffering)  # type: ignore[call-overload]

    def sendall(self, data: Any) -> None:
        self._sock.settimeout(self._write_s)
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _head_done(head: bytearray) -> bool:
    return b"\r\n\r\n" in head or b"\n\n" in head


def _path(head: bytes) -> str:
    parts = head.split(b"\n", 1)[0].split()
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) >= 2 else ""


class BoundedServer(HTTPServer):
    """An HTTPServer that reads each request head on one reader thread under a whole-request
    deadline and serves complete requests on a bounded pool (see the module doc). Give the
    handler a ``timeout``: it bounds each write."""

    request_queue_size = 128  # the listen backlog: a burst of probes is not left to SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_workers: int,
        thread_name: str = "otel-gpu-http",
        *,
        request_s: float | None = None,
        probe_paths: Collection[str] = (),
    ) -> None:
        """``request_s``: how long a client may take to send its whole request (default: the
        handler's ``timeout``, else 5 s); ``probe_paths``: the paths served on the reserved
        probe worker when every other worker is busy."""
        # Before binding: a bind that fails calls server_close(), which shuts the pool down
        # (the pool starts no thread until a connection comes).
        self._slots = threading.BoundedSemaphore(max_workers)
        self._probes = frozenset(probe_paths)
        self._probe_slots = threading.BoundedSemaphore(PROBE_WORKERS)
        workers = max_workers + (PROBE_WORKERS if self._probes else 0)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=thread_name)
        timeout = getattr(handler, "timeout", None)
        self._write_s = float(timeout) if timeout else 5.0
        self._request_s = float(request_s) if request_s else self._write_s
        self.refused = 0  # connections closed because all workers were taken
        self.expired = 0  # connections closed because their request was not sent in time
        self._arrivals: list[_Pending] = []
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        self._lock = threading.Lock()
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._reader: threading.Thread | None = None
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)
        self._reader = threading.Thread(
            target=self._read_heads, name=f"{thread_name}-reader", daemon=True
        )
        self._reader.start()

    # -- the reader: request heads, without blocking, under their deadline ---------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        """From the accept loop: hand the connection to the reader (never blocks)."""
        try:
            request.setblocking(False)
        except OSError:
            self.shutdown_request(request)
            return
        pending = _Pending(request, client_address, time.monotonic() + self._request_s)
        with self._lock:
            if self._closed:
                self.shutdown_request(request)
                return
            self._arrivals.append(pending)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # already awake (buffer full) or closing
            self._wake_w.send(b"x")

    def _read_heads(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
                arrivals, self._arrivals = self._arrivals, []
            for p in arrivals:
                self._admit(p)
            now = time.monotonic()
            for p in [p for p in self._pending.values() if p.deadline <= now]:
                self.expired += 1
                self._drop(p)
            soonest = min((p.deadline for p in self._pending.values()), default=now + 1.0)
            for key, _ in self._selector.select(max(0.0, min(soonest - now, 1.0))):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                    continue
                self._read(key.data)
        for p in list(self._pending.values()):
            self._drop(p)

    def _admit(self, p: _Pending) -> None:
        if len(self._pending) >= PENDING_MAX:
            self.expired += 1
            self._drop(next(iter(self._pending.values())))  # the oldest waiting one
        try:
            self._selector.register(p.sock, selectors.EVENT_READ, p)
        except (OSError, ValueError):
            self.shutdown_request(p.sock)
            return
        self._pending[p.sock] = p

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        self.shutdown_request(p.sock)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(p.sock)

    def _read(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client hung up before sending its request
            self._drop(p)
            return
        p.head += chunk
        if _head_done(p.head):
            self._forget(p)
            self._dispatch(p)
        elif len(p.head) > HEAD_MAX:
            self._drop(p)

    def _dispatch(self, p: _Pending) -> None:
        """A complete request head: serve it on a worker (a probe on the reserved one when
        all others are busy), or close it when none is free."""
        slot = self._slots
        if not slot.acquire(blocking=False):
            slot = self._probe_slots
            if not (_path(bytes(p.head)) in self._probes and slot.acquire(blocking=False)):
                self.refused += 1
                self.shutdown_request(p.sock)  # all workers busy: refuse rather than queue
                return
        try:
            p.sock.setblocking(True)
            conn = _Connection(p.sock, bytes(p.head), p.deadline, self._write_s)
            self._pool.submit(self._serve, conn, p.address, slot)
        except (RuntimeError, OSError):  # the pool is shut down: the server is closing
            slot.release()
            self.shutdown_request(p.sock)

    def _serve(self, request: Any, client_address: Any, slot: threading.BoundedSemaphore) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            slot.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or timed out is not worth a traceback

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            self._closed = True
        self._wake()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        if self._reader is None or not self._reader.is_alive():
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
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
        how long a connection may take to send its whole request. The probe paths among
        ``routes`` are served even while every other worker is busy."""
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
            self._server = BoundedServer(
                (host, port),
                Handler,
                max_connections,
                thread_name,
                request_s=idle_s,
                probe_paths=PROBE_PATHS & set(table),
            )
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
