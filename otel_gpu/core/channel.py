"""The local control channel between otel-gpu and the in-process part of a job's processes.

Each process running the in-process part (``opentelemetry-instrument``, ``otel_gpu.init()``,
the trainer callbacks, or a job started by ``otel-gpu run``) serves one Unix stream socket,
``<runtime dir>/proc-<pid>.sock`` (:mod:`otel_gpu.core.runtime_dir`: mode 0700, this user's
only). No TCP port: only processes of the same user can connect — the socket is 0600 in a
private directory, and the server also checks each peer's uid (``SO_PEERCRED``), so a socket
reached through a leaked descriptor or a bind mount answers nobody else either.

Protocol: one request per connection. The client sends one JSON object on one line —
``{"op": NAME, ...arguments}`` — and reads one JSON object on one line back: the handler's
result, or ``{"error": "one line"}``. Requests are at most :data:`MAX_REQUEST` bytes and must
arrive within :data:`REQUEST_DEADLINE_S`; replies at most :data:`MAX_REPLY` bytes. Each request
runs on a thread of its own (at most :data:`MAX_CONCURRENT` at once; more are refused), never
on the job's threads: a handler holds the GIL only as long as its Python work takes.

Handlers are registered by the part that owns the concern (progress for the agent's step-aware
detection, memory census, stacks, flight-recorder dumps); this module knows none of them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("otel_gpu")

Handler = Callable[[Mapping[str, Any]], Mapping[str, Any]]

MAX_REQUEST = 64 * 1024  # bytes of one request line
MAX_REPLY = 8 * 1024 * 1024  # bytes of one reply line
REQUEST_DEADLINE_S = 2.0  # to send the whole request
MAX_CONCURRENT = 4  # requests handled at once; more are answered "busy"
SOCKET_PREFIX = "proc-"


class ChannelError(Exception):
    """A request that got no usable answer: the one-line reason."""


def socket_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{SOCKET_PREFIX}{pid}.sock")


# Set by ``otel-gpu run`` in its job's environment: a trainer then leaves its final progress
# in LAST_WORDS_PREFIX<pid>.json when it exits, which the wrapper reads (and removes) for the
# steps and phases it ended after the last poll (agent/trainers.py).
WATCHED_BY_ENV = "OTEL_GPU_WATCHED_BY"
LAST_WORDS_PREFIX = "progress-"
LAST_WORDS_MAX_BYTES = 1 << 20


def last_words_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{LAST_WORDS_PREFIX}{pid}.json")


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _read_line(conn: socket.socket, limit: int, deadline: float) -> bytes:
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelError("timed out")
        conn.settimeout(left)
        try:
            chunk = conn.recv(min(65536, limit + 1 - len(buf)))
        except TimeoutError:
            raise ChannelError("timed out") from None
        if not chunk:
            raise ChannelError("connection closed before a whole line")
        end = chunk.find(b"\n")
        if end >= 0:
            buf += chunk[:end]
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            raise ChannelError(f"line longer than {limit} bytes")


class ControlServer:
    """Serves ``handlers`` (op → handler) on ``path`` from a daemon thread; never raises into
    the caller after construction. ``close()`` (also at exit) removes the socket file."""

    def __init__(self, path: str, handlers: Mapping[str, Handler]) -> None:
        self.path = path
        self._handlers = dict(handlers)
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self._owner = os.getpid()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a previous process of this PID (ours: the directory is private)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(16)
        self._sock = sock
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="otel-gpu-control", daemon=True).start()
        atexit.register(self.close)
        os.register_at_fork(after_in_child=self._forget)

    def register(self, op: str, handler: Handler) -> None:
        self._handlers[op] = handler

    @property
    def ops(self) -> list[str]:
        """The operations served, sorted."""
        return sorted(self._handlers)

    def _forget(self) -> None:
        # A forked child (a DataLoader worker) has the listening socket but no server thread:
        # close its copy; the parent keeps serving and keeps the file.
        with contextlib.suppress(OSError):
            self._sock.close()
        self._closed.set()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.1)
                continue
            if _peer_uid(conn) != os.getuid():
                conn.close()  # another user: no answer at all
                continue
            if not self._slots.acquire(blocking=False):
                self._reply(conn, {"error": "busy: too many requests at once"})
                conn.close()
                continue
            threading.Thread(
                target=self._handle, args=(conn,), name="otel-gpu-control-request", daemon=True
            ).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            try:
                line = _read_line(conn, MAX_REQUEST, time.monotonic() + REQUEST_DEADLINE_S)
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("not a JSON object")
            except (ChannelError, ValueError) as exc:
                self._reply(conn, {"error": f"bad request: {exc}"})
                return
            op = request.get("op")
            handler = self._handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                known = ", ".join(sorted(self._handlers))
                self._reply(conn, {"error": f"unknown op {op!r}: this process serves {known}"})
                return
            try:
                result = dict(handler(request))
            except Exception as exc:  # a handler's bug is this request's answer, nothing more
                log.debug("control op %s failed", op, exc_info=True)
                result = {"error": f"{op} failed: {type(exc).__name__}: {exc}"[:500]}
            self._reply(conn, result)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            self._slots.release()

    @staticmethod
    def _reply(conn: socket.socket, body: Mapping[str, Any]) -> None:
        try:
            data = json.dumps(body, default=str).encode() + b"\n"
        except (TypeError, ValueError, RecursionError) as exc:
            # a handler's result JSON cannot carry (a tuple key, a cycle): still one answer
            data = (
                json.dumps({"error": f"the reply could not be encoded: {exc}"[:500]}).encode()
                + b"\n"
            )
        if len(data) > MAX_REPLY:
            data = (
                json.dumps({"error": f"reply of {len(data)} bytes is over the limit"}).encode()
                + b"\n"
            )
        with contextlib.suppress(OSError):
            conn.settimeout(5.0)
            conn.sendall(data)

    def close(self) -> None:
        if os.getpid() != self._owner or self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def request(path: str, op: str, timeout_s: float = 5.0, **args: Any) -> dict[str, Any]:
    """Send one request to the server at ``path``; its reply. ChannelError (one line) when
    nothing serves there, it does not answer within ``timeout_s``, or it answers an error."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
        except FileNotFoundError:
            raise ChannelError("no in-process part serves there") from None
        except ConnectionRefusedError:
            raise ChannelError("the process that served there is gone") from None
        except OSError as exc:
            raise ChannelError(exc.strerror or str(exc)) from None
        line = _read_line(sock, MAX_REPLY, deadline)
    finally:
        sock.close()
    try:
        reply = json.loads(line)
    except ValueError:
        raise ChannelError("the reply is not JSON") from None
    if not isinstance(reply, dict):
        raise ChannelError("the reply is not a JSON object")
    if "error" in reply:
        raise ChannelError(str(reply["error"]))
    return reply


def process_socket(pid: int) -> str:
    """Where process ``pid`` serves its channel: ``proc-<pid>.sock`` in the runtime directory
    its environment names (``/proc/<pid>/environ``, readable by the same user only), else in
    this process's own runtime directory (docs/inprocess.md, "Discovery")."""
    from otel_gpu.core.runtime_dir import RUNTIME_DIR_ENV, runtime_dir

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read(1 << 20).split(b"\0")
    except OSError:
        environ = []
    prefix = RUNTIME_DIR_ENV.encode() + b"="
    for entry in environ:
        if entry.startswith(prefix):
            directory = os.fsdecode(entry[len(prefix) :]).strip()
            if os.path.isabs(directory):
                return socket_path(directory, pid)
    return socket_path(runtime_dir(), pid)
