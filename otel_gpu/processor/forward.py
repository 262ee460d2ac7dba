"""Forward request bytes to one downstream OTLP gRPC endpoint through a bounded queue.

Ingestion only ever appends to the queue (never waits): when the queue is full the request is
dropped and counted, so a slow or dead downstream costs data for that downstream, never
ingestion. One sender thread per downstream sends in order, retrying retryable failures with
exponential backoff (or the downstream's RetryInfo delay) for up to ``retry_s``. A request is
sent as received; requests arriving within ``linger_s`` of each other, or queued while the
downstream is busy, are merged into one call (up to 64 requests or 4 MiB).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque

import grpc
from google.rpc import error_details_pb2, status_pb2

from otel_gpu.processor.config import Downstream

log = logging.getLogger(__name__)

_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.DATA_LOSS,
    }
)


_BATCH_MAX = 64  # requests merged into one downstream call at most


def _identity(b: bytes) -> bytes:
    return b


def retry_delay(error: grpc.RpcError) -> float | None:
    """The server's RetryInfo delay in seconds, if it sent one."""
    try:
        trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    except Exception:
        return None
    raw = trailers.get("google.rpc.retryinfo-bin")
    info = error_details_pb2.RetryInfo()
    try:
        if raw is not None:
            info.ParseFromString(raw)
        elif trailers.get("grpc-status-details-bin") is not None:
            status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
            if not any(d.Unpack(info) for d in status.details if d.Is(info.DESCRIPTOR)):
                return None
        else:
            return None
    except Exception:
        return None
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


class Forwarder:
    """Queue + sender thread for one downstream. ``submit`` is safe from any thread."""

    def __init__(
        self,
        downstream: Downstream,
        max_requests: int,
        max_bytes: int,
        timeout_s: float,
        retry_s: float,
        max_message_bytes: int,
        linger_s: float = 0.02,
    ) -> None:
        self.downstream = downstream
        self._max_requests = max_requests
        self._max_bytes = max_bytes
        self._timeout = timeout_s
        self._retry_s = retry_s
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        if downstream.tls:
            self._channel = grpc.secure_channel(
                downstream.target, grpc.ssl_channel_credentials(), options=options
            )
        else:
            self._channel = grpc.insecure_channel(downstream.target, options=options)
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._queue: deque[tuple[str, bytes, float]] = deque()  # (method, payload, queued at)
        self._bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = float("inf")  # monotonic time after which pending data is dropped
        self.sent = 0  # requests delivered
        self.dropped = 0  # requests dropped: queue full, retries exhausted, or shutdown
        self.failed = 0  # of those, rejected by the downstream with a non-retryable error
        self.retries = 0
        self.calls = 0  # downstream calls made (several queued requests may share one)
        self._linger_s = linger_s
        self._batch_bytes = max(1, min(max_message_bytes, 4 * 1024 * 1024))
        self._thread = threading.Thread(
            target=self._run, name=f"otel-gpu-forward-{downstream.target}", daemon=True
        )
        self._thread.start()

    def submit(self, method: str, payload: bytes) -> bool:
        """Queue ``payload`` for ``method`` (e.g. the metrics Export path); False if dropped."""
        with self._cond:
            if (
                self._closing
                or len(self._queue) >= self._max_requests
                or self._bytes + len(payload) > self._max_bytes
            ):
                self.dropped += 1
                return False
            self._queue.append((method, payload, time.monotonic()))
            self._bytes += len(payload)
            self._cond.notify()
        return True

    def depth(self) -> int:
        """Requests waiting to be sent."""
        return len(self._queue)

    def _call(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        call = self._calls.get(method)
        if call is None:
            call = self._calls[method] = self._channel.unary_unary(
                method, request_serializer=_identity, response_deserializer=_identity
            )
        return call

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                # Linger briefly so that requests arriving together share a call.
                while (
                    not self._closing
                    and len(self._queue) < _BATCH_MAX
                    and time.monotonic() < self._queue[0][2] + self._linger_s
                ):
                    self._cond.wait(self._queue[0][2] + self._linger_s - time.monotonic())
                method, first, _ = self._queue[0]
                # Requests that queued up behind a slow send go out as one call: OTLP export
                # requests are one repeated field, so their encodings concatenate into the
                # encoding of the merged request (the same data, fewer calls).
                parts, size = [first], len(first)
                for m, p, _ in itertools.islice(self._queue, 1, _BATCH_MAX):
                    if m != method or size + len(p) > self._batch_bytes:
                        break
                    parts.append(p)
                    size += len(p)
            delivered = self._send(method, first if len(parts) == 1 else b"".join(parts))
            with self._cond:
                if not self._queue or self._queue[0][1] is not first:
                    return  # close() gave up on the queue meanwhile and counted it
                for _ in parts:
                    self._queue.popleft()
                self._bytes -= size
                self.calls += 1
                if delivered:
                    self.sent += len(parts)
                else:
                    self.dropped += len(parts)

    def _send(self, method: str, payload: bytes) -> bool:
        give_up = time.monotonic() + self._retry_s
        attempt = 0
        failing_since: float | None = None  # the first failure of this request
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                self._call(method)(payload, timeout=min(self._timeout, remaining))
                return True
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code not in _RETRYABLE:
                    self.failed += 1
                    log.warning(
                        "forward to %s rejected (%s): dropped one request",
                        self.downstream.target,
                        code,
                    )
                    return False
                delay = retry_delay(e)
                if delay is None:
                    delay = min(0.5 * 2**attempt, 10.0)
                attempt += 1
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                if now + delay > min(give_up, self._deadline):
                    log.warning(
                        "forward to %s failed (%s) for %.0f s: dropped one request",
                        self.downstream.target,
                        code,
                        now - failing_since,
                    )
                    return False
                self.retries += 1
                with self._cond:
                    # Woken early by close(); the loop then re-checks the deadline.
                    self._cond.wait(delay)

    def close(self, timeout_s: float) -> None:
        """Stop accepting, send what is queued for at most ``timeout_s``, drop the rest."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify_all()
        self._thread.join(timeout_s + 1.0)
        with self._cond:
            self.dropped += len(self._queue)
            self._queue.clear()
            self._bytes = 0
        self._channel.close()
