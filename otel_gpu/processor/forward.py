"""Forward accepted requests to one downstream OTLP gRPC endpoint through a bounded queue.

Ingestion only ever appends to the queue (never waits): when the queue is full the request is
refused and counted, so a slow or dead downstream costs data for that downstream, never
ingestion. The queue is in memory, or on disk with ``--queue-dir`` (:mod:`.queue`), where it
survives restarts. One sender thread per downstream sends in order, retrying retryable failures
with jittered exponential backoff (or the downstream's RetryInfo delay, capped) for up to
``retry_s``; with a disk queue it keeps retrying for as long as the data fits on disk. The
backoff is bounded at any attempt number (:mod:`otel_gpu.core.backoff`), and the retry wait is
its own timer: new requests arriving (which wake the sender when it is idle) never cut a
backoff short, so a stream of exports during an outage cannot turn into a retry storm.

The sender thread is supervised: an exception it did not expect (a bug, a queue that fails in
a way nobody foresaw) is logged once per episode and the loop restarted after a backoff; the
requests it was sending stay queued and are sent after the restart. While it is down,
:meth:`Forwarder.problem` names the reason, so ``/healthz`` says degraded.

Requests queued together are merged into one call (up to 64 requests or 4 MiB): OTLP export
requests are one repeated field, so their encodings concatenate into the encoding of the
merged request. Every request was fully parsed before it was accepted, so a merged call holds
only valid OTLP; still, when a downstream rejects a merged call as invalid, its requests are
sent again one by one, so one client's data that a stricter downstream refuses never costs
another client theirs. Rejections, give-ups and ``partial_success`` answers are counted and
logged once per episode (until a call succeeds in full).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from otel_gpu.core.backoff import exponential
from otel_gpu.processor.queue import ForwardQueue
from otel_gpu.processor.settings import Downstream
from otel_gpu.processor.telemetry import SIGNALS
from otel_gpu.processor.wire import PartialSuccessView

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
_BACKOFF_MAX_S = 10.0
_RETRY_INFO_MAX_S = 300.0  # a downstream's RetryInfo delay is honoured up to this
_RESTART_BASE_S = 0.5  # first restart of a crashed sender; doubles up to _RESTART_MAX_S
_RESTART_MAX_S = 30.0


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
    delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    # A hostile or broken downstream cannot park the sender for ever (or overflow its wait).
    return min(max(delay, 0.0), _RETRY_INFO_MAX_S)


def backoff(attempt: int, rand: float) -> float:
    """Delay before retry ``attempt`` (0-based): 0.5 s doubling to 10 s, times 0.5..1.5 as
    ``rand`` goes 0..1 (the Collector's randomization factor), so that processors that lost
    the same downstream do not all retry at the same instant."""
    return exponential(attempt, 0.5, _BACKOFF_MAX_S) * (0.5 + rand)


class Forwarder:
    """Queue + sender thread for one downstream. ``submit`` is safe from any thread."""

    def __init__(
        self,
        downstream: Downstream,
        queue: ForwardQueue,
        timeout_s: float,
        retry_s: float,
        max_message_bytes: int,
        *,
        durable: bool = False,
        linger_s: float = 0.02,
    ) -> None:
        self.downstream = downstream
        self._queue = queue
        self._timeout = timeout_s
        # A disk queue holds data through an outage of any length: never give up on it.
        self._retry_s = float("inf") if durable else retry_s
        self.durable = durable
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
        self._cond = threading.Condition()  # work available (submit) and counters
        self._stop = threading.Event()  # close(): the only thing that cuts a retry wait short
        self._closing = False
        self._deadline = float("inf")  # monotonic time after which pending data is left
        self._random = random.Random()
        self.sent = 0  # requests delivered
        self.dropped = 0  # requests lost: queue full, retries exhausted, rejected, shutdown
        self.dropped_by_method: Counter[str] = Counter()  # the same, per export method
        self.refused = 0  # of those, refused because the queue was full (or the disk failed)
        self.failed = 0  # of those, rejected by the downstream with a non-retryable error
        self.retries = 0
        self.calls = 0  # downstream calls made (several queued requests may share one)
        self.partial_rejected = 0  # items the downstream reported rejected in partial_success
        self.restarts = 0  # the sender thread's loop crashed and was started again
        self._down: str | None = None  # why the sender is not running, while it is not
        self._crashes = 0  # crashes in a row, since the sender last made progress
        self._partial_warned = False
        self._rejected_warned = False
        self._gave_up_warned = False
        self._linger_s = linger_s
        self._batch_bytes = max(1, min(max_message_bytes, 4 * 1024 * 1024))
        self._thread = threading.Thread(
            target=self._supervise, name=f"otel-gpu-forward-{downstream.target}", daemon=True
        )
        self._thread.start()

    @property
    def queue_errors(self) -> int:
        """Writes or reads the disk queue failed (0 for a memory queue)."""
        return self._queue.errors

    def submit(self, method: str, payload: bytes) -> bool:
        """Queue ``payload`` for ``method`` (e.g. the metrics Export path); False if refused."""
        if self._closing or not self._queue.put(method, payload):
            with self._cond:
                self._drop(method)
                self.refused += 1
            return False
        with self._cond:
            self._cond.notify()
        return True

    def _drop(self, method: str) -> None:
        self.dropped += 1
        self.dropped_by_method[method] += 1

    def room(self, size: int) -> bool:
        """Whether a request of ``size`` bytes would be queued now."""
        return not self._closing and self._queue.room(size)

    def depth(self) -> int:
        """Requests waiting to be sent."""
        return len(self._queue)

    def queued_bytes(self) -> int:
        return self._queue.bytes()

    def snapshot(self) -> dict[str, Any]:
        """The counters, for /stats and self-telemetry."""
        return {
            "dropped_by_signal": {SIGNALS[m]: n for m, n in self.dropped_by_method.items()},
            "sent": self.sent,
            "calls": self.calls,
            "dropped": self.dropped,
            "refused": self.refused,
            "failed": self.failed,
            "retries": self.retries,
            "partial_rejected": self.partial_rejected,
            "restarts": self.restarts,
            "queued": self.depth(),
            "queued_bytes": self.queued_bytes(),
            "queue_errors": self.queue_errors,
            "queue_corrupt": self._queue.corrupt,
            "durable": self.durable,
        }

    def problem(self) -> str | None:
        """Why health is degraded by this downstream's queue, if it is."""
        if self._queue.failing:
            return f"the disk queue of {self.downstream.target} cannot be written"
        return self._down

    def _supervise(self) -> None:
        """Run the sender loop; restart it (after a growing delay) when it raises."""
        while True:
            try:
                self._run()
                return
            except Exception as e:
                with self._cond:
                    self.restarts += 1
                    self._crashes += 1
                    crashes = self._crashes
                    self._down = (
                        f"the forwarder to {self.downstream.target} crashed "
                        f"({type(e).__name__}); restarting it (restart {self.restarts})"
                    )
                if crashes == 1:  # once per episode; the rest are counted in restarts
                    log.exception(
                        "forward to %s: the sender crashed; restarting it (queued requests "
                        "are kept; further crashes are counted in /stats forward.restarts)",
                        self.downstream.target,
                    )
                if self._closing:
                    return  # shutting down: close() accounts for what is left
                self._stop.wait(exponential(crashes - 1, _RESTART_BASE_S, _RESTART_MAX_S))

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` (at most until the close deadline). close() cuts the wait that is
        running when it is called short, so that draining starts at once; later waits of the
        drain are waited out, so a dead downstream is not hammered while closing."""
        left = max(0.0, min(seconds, self._deadline - time.monotonic()))
        if self._stop.is_set():
            time.sleep(left)
        else:
            self._stop.wait(left)

    def _progress(self) -> None:
        """The sender works (a call answered, or nothing left to send): not down."""
        if self._down is not None or self._crashes:
            with self._cond:
                self._down = None
                self._crashes = 0

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
                while not len(self._queue) and not self._closing:
                    self._progress()
                    self._cond.wait(1.0)  # also wakes to retry a disk read that failed
                if not len(self._queue) or time.monotonic() >= self._deadline:
                    return
                # Linger briefly so that requests arriving together share a call.
                until = time.monotonic() + self._linger_s
                while not self._closing and len(self._queue) < _BATCH_MAX:
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            batch = self._queue.peek(_BATCH_MAX, self._batch_bytes)
            if not batch:
                self._pause(0.5)  # a failed disk read: retried on a timer, not per submit
                continue
            method = batch[0][1]
            parts = [p for _, _, p in batch]
            outcome = self._send(method, parts[0] if len(parts) == 1 else b"".join(parts))
            if outcome == "invalid" and len(parts) > 1:
                # One request the downstream refuses must not cost the others in the call.
                outcomes = [self._send(method, p) for p in parts]
            else:
                outcomes = [outcome] * len(parts)
            # Requests cut off by shutdown stay queued: a disk queue keeps them for the next
            # start, close() counts them as dropped for a memory queue.
            done = [
                (item[0], o) for item, o in zip(batch, outcomes, strict=True) if o != "deadline"
            ]
            self._queue.ack([i for i, _ in done])
            self._progress()
            with self._cond:
                self.calls += 1
                for _, o in done:
                    if o == "ok":
                        self.sent += 1
                    else:
                        self._drop(method)
            if len(done) < len(batch):
                return

    def _send(self, method: str, payload: bytes) -> str:
        """'ok', 'invalid' (rejected, not retryable), 'gave_up' or 'deadline' (shutdown)."""
        give_up = time.monotonic() + self._retry_s
        attempt = 0
        failing_since: float | None = None  # the first failure of this request
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                return "deadline"
            try:
                reply = self._call(method)(payload, timeout=min(self._timeout, remaining))
                self._rejected_warned = self._gave_up_warned = False
                self._partial(reply)
                return "ok"
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code not in _RETRYABLE:
                    self.failed += 1
                    if not self._rejected_warned:  # once per episode, until a call succeeds
                        self._rejected_warned = True
                        log.warning(
                            "forward to %s rejected (%s: %s): dropped the request; further "
                            "rejections are counted in /stats forward.failed",
                            self.downstream.target,
                            code,
                            e.details() if hasattr(e, "details") else "",
                        )
                    return "invalid"
                delay = retry_delay(e)
                if delay is None:
                    delay = backoff(attempt, self._random.random())
                attempt += 1
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                if self.durable and now + delay > self._deadline:
                    return "deadline"  # shutting down: stays on disk for the next start
                if now + delay > min(give_up, self._deadline):
                    if not self._gave_up_warned:  # once per outage, until a call succeeds
                        self._gave_up_warned = True
                        log.warning(
                            "forward to %s failed (%s) for %.0f s: dropped one request; "
                            "further drops are counted in /stats forward.dropped",
                            self.downstream.target,
                            code,
                            now - failing_since,
                        )
                    return "gave_up"
                self.retries += 1
                # Woken early by close() only, never by new work; the loop then re-checks
                # the deadline.
                self._pause(delay)

    def _partial(self, reply: bytes) -> None:
        """Count what the downstream accepted the call but rejected inside it."""
        if not reply:
            self._partial_warned = False
            return
        try:
            ps = PartialSuccessView.FromString(reply).partial_success
        except Exception:
            return  # a reply we cannot read is still a success
        if ps.rejected <= 0:
            self._partial_warned = False
            return
        with self._cond:
            self.partial_rejected += ps.rejected
        if not self._partial_warned:  # once per episode, not once per call
            self._partial_warned = True
            log.warning(
                "forward to %s: the downstream rejected %d items (%s); counted in "
                "/stats forward.partial_rejected",
                self.downstream.target,
                ps.rejected,
                ps.error_message or "no reason given",
            )

    def close(self, timeout_s: float) -> None:
        """Stop accepting, send what is queued for at most ``timeout_s``; a memory queue drops
        the rest (counted), a disk queue keeps it for the next start."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify_all()
        self._stop.set()
        self._thread.join(timeout_s + 1.0)
        lost = self._queue.close()
        with self._cond:
            for method in lost:
                self._drop(method)
        self._channel.close()
