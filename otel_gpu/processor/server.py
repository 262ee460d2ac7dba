"""The OTLP gRPC processor service: receive, check, detect, forward.

Requests arrive through generic gRPC handlers with identity (de)serializers, so the processor
holds the exact bytes the client sent and forwards them unchanged (a rejected point is the only
thing ever cut out). Per request: bearer token (checked from the call's metadata before its body
is read) -> admission (memory limit, in-flight cap, optional rate) -> a full protobuf parse
(what is accepted is valid OTLP, so one client's bytes can never spoil a merged downstream call
for another) -> detection on the routed series (metrics) -> queue the bytes for every
downstream -> reply, with ``partial_success`` when points were rejected. Refusals:
UNAUTHENTICATED (token), RESOURCE_EXHAUSTED with a RetryInfo delay (overload or memory; the OTel
exporters wait that long and retry), INVALID_ARGUMENT (malformed), RESOURCE_EXHAUSTED from gRPC
itself for a body over ``max_recv_bytes`` after decompression.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_gpu.core.addresses import format_hostport, parse_hostport
from otel_gpu.core.errors import UsageError
from otel_gpu.core.private_files import private_dir
from otel_gpu.detect.breaker import Breaker, BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.processor.admission import Admission, Refused
from otel_gpu.processor.calls import CallGuard, peer_address
from otel_gpu.processor.datamodel import count_items, histogram_violations
from otel_gpu.processor.decode import strip_rejected
from otel_gpu.processor.forward import Forwarder
from otel_gpu.processor.health import HealthServer
from otel_gpu.processor.memlimit import MemoryLimiter
from otel_gpu.processor.pipeline import Actions, Detection
from otel_gpu.processor.queue import DiskQueue, ForwardQueue, MemoryQueue, queue_file
from otel_gpu.processor.scrape import DETECTOR, TELEMETRY, ProcessorScrape
from otel_gpu.processor.settings import ProcessorConfig, bind_problem
from otel_gpu.processor.store import StateStore
from otel_gpu.processor.telemetry import SIGNALS, self_metrics_request
from otel_gpu.processor.wire import (
    HEALTH_NOT_SERVING,
    HEALTH_SERVICE,
    HEALTH_SERVING,
    LOGS_EXPORT,
    LOGS_SERVICE,
    METRICS_EXPORT,
    METRICS_SERVICE,
    TRACE_EXPORT,
    TRACE_SERVICE,
    retry_trailers,
)

log = logging.getLogger("otel_gpu.processor")

_TICK_S = 0.2  # how often pending points, evictions and detector metrics are looked at

# The full parse that validates each request before it is accepted, per export method.
_PARSERS: dict[str, Any] = {
    METRICS_EXPORT: ExportMetricsServiceRequest,
    TRACE_EXPORT: ExportTraceServiceRequest,
    LOGS_EXPORT: ExportLogsServiceRequest,
}


class Processor:
    """One processor service. ``start()`` binds and serves; ``stop()`` drains (bounded)."""

    def __init__(
        self,
        config: ProcessorConfig,
        *,
        engine: Engine | None = None,
        breaker_config: BreakerConfig | None = None,
        actions: Any = None,
        memory: MemoryLimiter | None = None,
        scrape: ProcessorScrape | None = None,
        queues: Callable[[str], ForwardQueue] | None = None,
    ) -> None:
        """``queues``: the forward queue for a downstream target (default: memory, or the
        disk queue of ``--queue-dir``)."""
        self.config = config
        self._scrape = scrape  # served until stop(), which closes it
        self._store = StateStore(config.state_path, source=config.source("state_path"))
        bcfg = breaker_config or BreakerConfig()
        saved = self._store.load_breaker()
        breaker = Breaker(bcfg)
        if saved is not None:
            try:
                breaker = Breaker.from_state(saved, bcfg)
            except ValueError as e:
                log.error("state %s: %s; starting with closed breakers", config.state_path, e)
        self._actions = actions
        self.forwarders = [
            Forwarder(
                d,
                (queues or self._queue_for)(d.target),
                config.forward_timeout_s,
                config.forward_retry_s,
                config.max_recv_bytes,
                durable=config.queue_dir is not None,
            )
            for d in config.forward
        ]
        self.memory = memory or MemoryLimiter(config.memory_limit_mib * 1024 * 1024)
        self._admission = Admission(config, self.memory)
        self.calls = CallGuard(config.max_calls_per_peer, config.receive_timeout_s)
        act: Actions | None = actions
        self.detection = Detection(
            config, engine or Engine(), breaker, self._store, act, self._send
        )
        self._counts: dict[str, int] = {}
        self._signals = {s: {"accepted": 0, "refused": 0} for s in SIGNALS.values()}
        self._counts_lock = threading.Lock()
        self._start_ns = time.time_ns()
        self._last_self_export = time.monotonic()
        self._last_accept: float | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None
        self._server: grpc.Server | None = None
        self._health: HealthServer | None = None
        self.address = ""  # bound gRPC address (after start)
        self.health_address = ""

    def _queue_for(self, target: str) -> ForwardQueue:
        cfg = self.config
        if cfg.queue_dir is None:
            return MemoryQueue(cfg.queue_requests, cfg.queue_bytes)
        try:
            private_dir(cfg.queue_dir)  # missing parents too: 0700
            return DiskQueue(queue_file(cfg.queue_dir, target), cfg.queue_dir_bytes)
        except (OSError, sqlite3.Error) as e:
            hint = (
                "another processor is using it: give each processor its own directory"
                if "locked" in str(e)
                else "give a writable directory"
            )
            raise UsageError(
                f"{cfg.source('queue_dir')}={cfg.queue_dir!r}: cannot keep a queue there ({e}); "
                f"{hint}"
            ) from None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        host, port = parse_hostport(cfg.listen, cfg.source("listen"))
        server = grpc.server(
            # More threads than in-flight slots, so an excess request reaches admit() and is
            # refused with a RetryInfo delay instead of waiting in gRPC's queue; and one peer's
            # calls waiting for their message (at most max_calls_per_peer, each for at most
            # receive_timeout_s) leave max_inflight threads to the others.
            futures.ThreadPoolExecutor(
                max_workers=cfg.max_inflight + cfg.max_calls_per_peer + 2,
                thread_name_prefix="otel-gpu-rpc",
            ),
            handlers=[self._handlers()],
            options=[
                ("grpc.so_reuseport", 0),  # a second processor on the port must fail, loudly
                ("grpc.max_receive_message_length", cfg.max_recv_bytes),
                ("grpc.max_send_message_length", cfg.max_recv_bytes),
            ],
            maximum_concurrent_rpcs=max(64, cfg.max_inflight * 8),  # hard backstop
        )
        target = format_hostport(host, port)
        try:
            if cfg.tls_cert and cfg.tls_key:
                creds = grpc.ssl_server_credentials([(_read(cfg.tls_key), _read(cfg.tls_cert))])
                bound = server.add_secure_port(target, creds)
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError:
            bound = 0
        if not bound:
            raise UsageError(
                f"{cfg.source('listen')}={cfg.listen!r}: cannot listen there "
                f"({bind_problem(host, port)})"
            )
        self.address = format_hostport(host, bound)
        if cfg.health:
            self._health = HealthServer(
                cfg.health,
                self.health,
                self.stats,
                cfg.health_max_connections,
                source=cfg.source("health"),
            )
            self.health_address = self._health.address
        server.start()
        self._server = server
        self._ticker = threading.Thread(target=self._tick_loop, name="otel-gpu-tick", daemon=True)
        self._ticker.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop taking requests, finish the ones in flight, flush detection, the store (firing
        its actions) and the downstream queues, close actions; all within ``timeout_s``
        (default flush_timeout_s)."""
        if self._stopping:
            return
        self._stopping = True
        budget = self.config.flush_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        if self._server is not None:
            self._server.stop(grace=budget / 3).wait(budget / 3 + 0.5)
        self._stopped.set()
        self.calls.close()
        if self._ticker is not None:
            self._ticker.join(1.0)
        try:
            self.detection.tick(final=True)
        except Exception:
            log.exception("final detection flush failed")
        # The store first: its writer fires the actions of what it still writes.
        self._store.close(max(0.1, min(2.0, deadline - time.monotonic())))
        for f in self.forwarders:
            f.close(max(0.0, deadline - time.monotonic()))
        if self._actions is not None and hasattr(self._actions, "close"):
            self._actions.close(max(0.1, deadline - time.monotonic()))
        if self._health is not None:
            self._health.close()
        if self._scrape is not None:
            self._scrape.close(max(0.1, min(2.0, deadline - time.monotonic())))

    def _tick_loop(self) -> None:
        while not self._stopped.wait(_TICK_S):
            try:
                self.memory.check()
                self.detection.tick()
                now = time.monotonic()
                every = self.config.telemetry_interval_s
                if every and now - self._last_self_export >= every:
                    self._last_self_export = now
                    self._export_self_metrics()
            except Exception:  # a bug here must not end ticking for good
                log.exception("processor tick failed")

    def _export_self_metrics(self) -> None:
        """The processor's own counters, downstream as OTLP metrics (as the Collector does)
        and on the scrape endpoint."""
        if self.forwarders or self._scrape is not None:
            payload = self_metrics_request(self.stats(), self._start_ns)
            for f in self.forwarders:
                f.submit(METRICS_EXPORT, payload)
            if self._scrape is not None:
                self._scrape.publish(TELEMETRY, payload)

    # -- gRPC plumbing -------------------------------------------------------------------------

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=None, response_serializer=None
            )

        def export(fn: Any) -> grpc.RpcMethodHandler:
            # A request stream, so the handler runs when the call begins, before its message:
            # the per-peer limit and the receive deadline apply to a call that never sends it.
            return grpc.stream_unary_rpc_method_handler(
                fn, request_deserializer=None, response_serializer=None
            )

        services = {
            METRICS_SERVICE: {"Export": export(self._rpc(METRICS_EXPORT, self.export_metrics))},
            TRACE_SERVICE: {"Export": export(self._rpc(TRACE_EXPORT, self._export_opaque))},
            LOGS_SERVICE: {"Export": export(self._rpc(LOGS_EXPORT, self._export_opaque))},
            HEALTH_SERVICE: {"Check": unary(self._grpc_health)},
        }

        admission = self._admission
        refusals = {
            path: grpc.stream_unary_rpc_method_handler(self._unauthenticated(SIGNALS[path]))
            for path in _PARSERS
        }

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                path: str = details.method  # type: ignore[attr-defined]
                service, _, method = path.lstrip("/").rpartition("/")
                handler = services.get(service, {}).get(method)
                if (
                    handler is not None
                    and path in _PARSERS
                    and not admission.authorized(
                        details.invocation_metadata  # type: ignore[attr-defined]
                    )
                ):
                    # Refused from the metadata alone: a stream handler that never reads the
                    # body, so unauthenticated bytes are never buffered or decoded.
                    return refusals[path]
                return handler

        return Handler()

    def _unauthenticated(self, signal: str) -> Any:
        def refuse(requests: Any, context: grpc.ServicerContext) -> bytes:
            self._count("unauthenticated", signal)
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send header 'authorization: Bearer <token>'",
            )
            raise AssertionError("unreachable")  # abort() raises

        return refuse

    def _rpc(self, method: str, body: Any) -> Any:
        signal = SIGNALS[method]
        guard = self.calls

        def receive(requests: Any, context: grpc.ServicerContext) -> bytes:
            """The per-peer limit, then the message under the receive deadline."""
            peer = peer_address(context.peer())
            if not guard.enter(peer):
                self._count("peer_limited", signal)
                message = (
                    f"too many concurrent calls from {peer} (--max-calls-per-peer "
                    f"{guard.per_peer}); retry later"
                )
                context.set_trailing_metadata(
                    retry_trailers(
                        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                        message,
                        self.config.retry_after_s,
                    )
                )
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            try:
                token = guard.watch(context.cancel)
                try:
                    request = next(requests, None)
                except grpc.RpcError:  # cancelled: by its deadline, or by the client
                    request = None
                if not guard.unwatch(token):
                    self._count("receive_timeouts", signal)
                    # Already cancelled: the client is told nothing more.
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no request message")
                if request is None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
                    raise AssertionError("unreachable")  # abort() raises
                return handle(request, context, peer)
            finally:
                guard.leave(peer)

        def handle(request: bytes, context: grpc.ServicerContext, peer: str) -> bytes:
            try:
                self._admission.admit()
                try:
                    reply = body(method, request, peer)
                finally:
                    self._admission.release()
                self._last_accept = time.monotonic()
                self._count("", signal)
                return reply  # type: ignore[no-any-return]
            except Refused as r:
                self._count(r.code.name.lower(), signal)
                if r.retry_s is not None:
                    context.set_trailing_metadata(
                        retry_trailers(r.code.value[0], r.message, r.retry_s)
                    )
                context.abort(r.code, r.message)
            except Exception:
                self._count("internal")
                log.exception("unexpected error handling %s", method)
                context.abort(grpc.StatusCode.INTERNAL, "internal error; see the processor log")
            raise AssertionError("unreachable")  # abort() raises

        return receive

    def _grpc_health(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return HEALTH_SERVING if self.health()[0] else HEALTH_NOT_SERVING

    # -- request bodies (also the in-process path used by the benchmark) ------------------------

    def _check_room(self, size: int) -> None:
        """With --queue-dir nothing accepted may be lost: while a disk queue is full (or its
        disk fails), refuse with a retry delay, before detection sees the data, so that the
        client keeps it and sends it again. A memory queue drops and counts instead: a dead
        downstream must not stop detection for everyone."""
        if self._store.disk_full:
            # History that cannot be kept means a restart would forget open breakers and
            # notify again: the client keeps its data until the disk has room.
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"the state store {self.config.state_path} cannot be written (disk full or "
                "file-size limit); retry later",
                self.config.retry_after_s,
            )
        for f in self.forwarders:
            if f.durable and not f.room(size):
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the disk queue for {f.downstream.target} is full (--queue-dir-mib); "
                    "retry later",
                    self.config.retry_after_s,
                )

    def _enqueue(self, method: str, payload: bytes) -> None:
        """Queue an accepted request for every downstream. A disk queue that cannot write it
        (a full disk, a file-size limit) refuses the request with a retry delay rather than
        answering OK for data it did not keep; the forwarder counts the refusal."""
        failed = [f for f in self.forwarders if not f.submit(method, payload) and f.durable]
        if failed:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"the disk queue for {failed[0].downstream.target} cannot be written "
                "(disk full or file-size limit); retry later",
                self.config.retry_after_s,
            )

    def export_metrics(self, method: str, raw: bytes, peer: str = "") -> bytes:
        """Handle one encoded ExportMetricsServiceRequest from ``peer`` (the client's address);
        returns the encoded response."""
        items, req = self._validate(method, raw)
        if not items:
            return b""
        self._check_room(len(raw))
        bad, first_error = histogram_violations(req)
        decoded = self.detection.ingest_metrics(raw, peer)
        self._count("metrics_requests")
        payload = raw
        rejected = decoded.rejected + len(bad)
        if rejected:
            self._count("rejected_requests")
            payload = strip_rejected(raw, decoded.bad + bad)
        if payload:
            self._enqueue(method, payload)
        if not rejected and not decoded.overflow:
            return b""
        messages = [m for m in (decoded.first_error or first_error,) if m and rejected]
        if decoded.overflow:
            # Forwarded all the same; but the client is told they were not judged.
            self._count("overflow_requests")
            messages.append(
                f"{decoded.overflow} data points of new GPUs or processes were not judged by "
                "the processor's detectors: over the subject caps (--max-series-per-peer, "
                "--max-series-per-reporter, --max-series); forwarded unchanged"
            )
        return ExportMetricsServiceResponse(
            partial_success=ExportMetricsPartialSuccess(
                rejected_data_points=rejected + decoded.overflow,
                error_message="; ".join(messages),
            )
        ).SerializeToString()

    def _validate(self, method: str, raw: bytes) -> tuple[int, Any]:
        """Parse ``raw`` in full (framing, every field's type, UTF-8 strings): INVALID_ARGUMENT
        for anything a strict downstream could refuse to decode. Returns how many items (data
        points, spans, log records) it holds, and the parsed request; a request with no items
        is accepted and dropped."""
        try:
            req = _PARSERS[method].FromString(raw)
            items = count_items(method, req)
        except DecodeError as e:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"not a valid OTLP export request ({e}); nothing of it was accepted",
            ) from None
        if not items:
            self._count("empty_requests")
        return items, req

    def _export_opaque(self, method: str, raw: bytes, peer: str = "") -> bytes:
        if not self._validate(method, raw)[0]:
            return b""
        self._check_room(len(raw))
        self._count("traces_requests" if method == TRACE_EXPORT else "logs_requests")
        self._enqueue(method, raw)
        return b""

    def _send(self, method: str, payload: bytes) -> None:
        """Detection's outputs: downstream, and its metrics on the scrape endpoint."""
        for f in self.forwarders:
            f.submit(method, payload)
        if method == METRICS_EXPORT and self._scrape is not None:
            self._scrape.publish(DETECTOR, payload)

    def _count(self, name: str, signal: str | None = None) -> None:
        """Count ``name`` (if any) and, with ``signal``, that signal's accepted ("" name) or
        refused request."""
        with self._counts_lock:
            if name:
                self._counts[name] = self._counts.get(name, 0) + 1
            if signal is not None:
                self._signals[signal]["refused" if name else "accepted"] += 1

    # -- health and stats ------------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """(healthy, one line) by the rule documented in :mod:`otel_gpu.processor.health`."""
        if self._stopping:
            return False, "stopping"
        problems = [self._store.problem(), self.memory.problem(), self.detection.problem()]
        problems += [f.problem() for f in self.forwarders]
        for problem in problems:
            if problem:
                return False, f"degraded: {problem}"
        # Refused calls are the limits doing their work: said, but not a failed probe (a
        # liveness restart would hand whoever sends them a way to restart the processor).
        calls = self.calls.problem()
        note = f"; {calls}" if calls else ""
        last = self._last_accept
        if last is None:
            return True, f"ok: waiting for data{note}"
        age = time.monotonic() - last
        if age > self.config.stall_after_s:
            return False, (
                f"stalled: no export request accepted for {age:.0f} s "
                f"(limit {self.config.stall_after_s:g} s){note}"
            )
        return True, f"ok: last export request {age:.1f} s ago{note}"

    def stats(self) -> dict[str, Any]:
        """Counters: requests by outcome, detection, each downstream, actions (no secrets)."""
        with self._counts_lock:
            out: dict[str, Any] = dict(self._counts)
            out["signals"] = {s: dict(c) for s, c in self._signals.items()}
        out["detection"] = asdict(self.detection.stats())
        out["forward"] = {f.downstream.target: f.snapshot() for f in self.forwarders}
        out["store"] = self._store.snapshot()
        out["memory"] = self.memory.snapshot()
        out["calls"] = self.calls.snapshot()
        if self._actions is not None and hasattr(self._actions, "stats"):
            out["actions"] = asdict(self._actions.stats)
        return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read TLS file {path!r}: {e.strerror}") from None
