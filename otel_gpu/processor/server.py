"""The OTLP gRPC processor service: receive, check, detect, forward.

Requests arrive through generic gRPC handlers with identity (de)serializers, so the processor
holds the exact bytes the client sent and forwards them unchanged (a rejected point is the only
thing ever cut out). Per request: bearer token -> admission (in-flight cap, optional rate) ->
decode the routed series and run detection (metrics) or check the framing (traces, logs) ->
queue the bytes for every downstream -> reply, with ``partial_success`` when points were
rejected. Refusals: UNAUTHENTICATED (token), RESOURCE_EXHAUSTED with a RetryInfo delay
(overload; the OTel exporters wait that long and retry), INVALID_ARGUMENT (malformed).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from concurrent import futures
from dataclasses import asdict
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)

from otel_gpu.detect.breaker import Breaker, BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.errors import UsageError
from otel_gpu.processor.config import (
    ProcessorConfig,
    bind_problem,
    format_hostport,
    parse_hostport,
)
from otel_gpu.processor.decode import strip_rejected
from otel_gpu.processor.forward import Forwarder
from otel_gpu.processor.health import HealthServer
from otel_gpu.processor.pipeline import Actions, Detection
from otel_gpu.processor.store import StateStore
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
    EnvelopeView,
    retry_trailers,
)

log = logging.getLogger("otel_gpu.processor")

_TICK_S = 0.2  # how often pending points, evictions and detector metrics are looked at


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_s = code, message, retry_s


class _RateLimit:
    """Token bucket over requests (burst = one second's worth)."""

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self._tokens = max(per_s, 1.0)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> float:
        """0 if admitted, else seconds until a token is due."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(max(self.per_s, 1.0), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.per_s


class Processor:
    """One processor service. ``start()`` binds and serves; ``stop()`` drains (bounded)."""

    def __init__(
        self,
        config: ProcessorConfig,
        *,
        engine: Engine | None = None,
        breaker_config: BreakerConfig | None = None,
        actions: Any = None,
    ) -> None:
        self.config = config
        self._token = None if config.token is None else config.token.encode()
        self._store = StateStore(config.state_path)
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
                config.queue_requests,
                config.queue_bytes,
                config.forward_timeout_s,
                config.forward_retry_s,
                config.max_recv_bytes,
            )
            for d in config.forward
        ]
        act: Actions | None = actions
        self.detection = Detection(
            config, engine or Engine(), breaker, self._store, act, self._send
        )
        self._inflight = threading.BoundedSemaphore(config.max_inflight)
        self._rate = _RateLimit(config.max_requests_per_s) if config.max_requests_per_s else None
        self._counts: dict[str, int] = {}
        self._counts_lock = threading.Lock()
        self._last_accept: float | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None
        self._server: grpc.Server | None = None
        self._health: HealthServer | None = None
        self.address = ""  # bound gRPC address (after start)
        self.health_address = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        host, port = parse_hostport(cfg.listen, "--listen")
        server = grpc.server(
            # More threads than in-flight slots, so an excess request reaches _admit and is
            # refused with a RetryInfo delay instead of waiting in gRPC's queue.
            futures.ThreadPoolExecutor(
                max_workers=cfg.max_inflight + 2, thread_name_prefix="otel-gpu-rpc"
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
                f"--listen {cfg.listen}: cannot listen there ({bind_problem(host, port)})"
            )
        self.address = format_hostport(host, bound)
        if cfg.health:
            self._health = HealthServer(cfg.health, self.health, self.stats)
            self.health_address = self._health.address
        server.start()
        self._server = server
        self._ticker = threading.Thread(target=self._tick_loop, name="otel-gpu-tick", daemon=True)
        self._ticker.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop taking requests, finish the ones in flight, flush detection and the downstream
        queues, close actions and the store; all within ``timeout_s`` (default flush_timeout_s)."""
        if self._stopping:
            return
        self._stopping = True
        budget = self.config.flush_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        if self._server is not None:
            self._server.stop(grace=budget / 3).wait(budget / 3 + 0.5)
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join(1.0)
        try:
            self.detection.tick(final=True)
        except Exception:
            log.exception("final detection flush failed")
        for f in self.forwarders:
            f.close(max(0.0, deadline - time.monotonic()))
        if self._actions is not None and hasattr(self._actions, "close"):
            self._actions.close(max(0.1, deadline - time.monotonic()))
        self._store.close()
        if self._health is not None:
            self._health.close()

    def _tick_loop(self) -> None:
        while not self._stopped.wait(_TICK_S):
            try:
                self.detection.tick()
            except Exception:  # a bug here must not end ticking for good
                log.exception("detection tick failed")

    # -- gRPC plumbing -------------------------------------------------------------------------

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=None, response_serializer=None
            )

        services = {
            METRICS_SERVICE: {"Export": unary(self._rpc(METRICS_EXPORT, self.export_metrics))},
            TRACE_SERVICE: {"Export": unary(self._rpc(TRACE_EXPORT, self._export_opaque))},
            LOGS_SERVICE: {"Export": unary(self._rpc(LOGS_EXPORT, self._export_opaque))},
            HEALTH_SERVICE: {"Check": unary(self._grpc_health)},
        }

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                service, _, method = details.method.lstrip("/").rpartition("/")  # type: ignore[attr-defined]
                return services.get(service, {}).get(method)

        return Handler()

    def _rpc(self, method: str, body: Any) -> Any:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                self._authorize(context)
                self._admit()
                try:
                    reply = body(method, request)
                finally:
                    self._inflight.release()
                self._last_accept = time.monotonic()
                return reply  # type: ignore[no-any-return]
            except _Refused as r:
                self._count(r.code.name.lower())
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

        return handle

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self._token is None:
            return
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                scheme, _, token = given.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token):
                    return
        raise _Refused(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token: send header 'authorization: Bearer <token>'",
        )

    def _admit(self) -> None:
        """Take an in-flight slot (released by the caller) or refuse with a retry delay."""
        retry = self.config.retry_after_s
        if not self._inflight.acquire(blocking=False):
            raise _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"processor busy ({self.config.max_inflight} requests in flight)",
                retry,
            )
        if self._rate is not None:
            wait = self._rate.take()
            if wait > 0:
                self._inflight.release()
                raise _Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"over the admission rate of {self._rate.per_s:g} requests/s",
                    max(retry, wait),
                )

    def _grpc_health(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return HEALTH_SERVING if self.health()[0] else HEALTH_NOT_SERVING

    # -- request bodies (also the in-process path used by the benchmark) ------------------------

    def export_metrics(self, method: str, raw: bytes) -> bytes:
        """Handle one encoded ExportMetricsServiceRequest; returns the encoded response."""
        try:
            decoded = self.detection.ingest_metrics(raw)
        except DecodeError as e:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"not a valid OTLP ExportMetricsServiceRequest ({e})",
            ) from None
        self._count("metrics_requests")
        payload = raw
        if decoded.rejected:
            self._count("rejected_requests")
            try:
                payload = strip_rejected(raw, decoded.bad)
            except DecodeError as e:
                raise _Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"not a valid OTLP ExportMetricsServiceRequest ({e})",
                ) from None
        if payload:
            self._send(method, payload)
        if not decoded.rejected:
            return b""
        return ExportMetricsServiceResponse(
            partial_success=ExportMetricsPartialSuccess(
                rejected_data_points=decoded.rejected, error_message=decoded.first_error
            )
        ).SerializeToString()

    def _export_opaque(self, method: str, raw: bytes) -> bytes:
        try:
            EnvelopeView.FromString(raw)
        except DecodeError as e:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a valid OTLP export request ({e})"
            ) from None
        self._count("traces_requests" if method == TRACE_EXPORT else "logs_requests")
        if raw:
            self._send(method, raw)
        return b""

    def _send(self, method: str, payload: bytes) -> None:
        for f in self.forwarders:
            f.submit(method, payload)

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] = self._counts.get(name, 0) + 1

    # -- health and stats ------------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """(healthy, one line) by the rule documented in :mod:`otel_gpu.processor.health`."""
        if self._stopping:
            return False, "stopping"
        last = self._last_accept
        if last is None:
            return True, "ok: waiting for data"
        age = time.monotonic() - last
        if age > self.config.stall_after_s:
            return False, (
                f"stalled: no export request accepted for {age:.0f} s "
                f"(limit {self.config.stall_after_s:g} s)"
            )
        return True, f"ok: last export request {age:.1f} s ago"

    def stats(self) -> dict[str, Any]:
        """Counters: requests by outcome, detection, each downstream, actions (no secrets)."""
        with self._counts_lock:
            out: dict[str, Any] = dict(self._counts)
        out["detection"] = asdict(self.detection.stats())
        out["forward"] = {
            f.downstream.target: {
                "sent": f.sent,
                "calls": f.calls,
                "dropped": f.dropped,
                "failed": f.failed,
                "retries": f.retries,
                "queued": f.depth(),
            }
            for f in self.forwarders
        }
        if self._actions is not None and hasattr(self._actions, "stats"):
            out["actions"] = asdict(self._actions.stats)
        return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read TLS file {path!r}: {e.strerror}") from None
