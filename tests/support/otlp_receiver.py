"""A downstream OTLP gRPC receiver that keeps every request, and a raw gRPC client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT, TRACE_EXPORT

PARSERS = {
    METRICS_EXPORT: ExportMetricsServiceRequest,
    TRACE_EXPORT: ExportTraceServiceRequest,
    LOGS_EXPORT: ExportLogsServiceRequest,
}


def _identity(b: bytes) -> bytes:
    return b


class Receiver:
    """A downstream OTLP gRPC receiver that keeps every request's bytes, per method."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.raw: dict[str, list[bytes]] = {m: [] for m in PARSERS}
        self.delay_s = delay_s
        self._cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {}
        for method in PARSERS:
            service, _, name = method.lstrip("/").rpartition("/")
            handlers.setdefault(service, {})[name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method), request_deserializer=_identity, response_serializer=_identity
            )
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(s, h) for s, h in handlers.items()]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def _handler(self, method: str) -> Callable[[bytes, Any], bytes]:
        def handle(request: bytes, context: Any) -> bytes:
            if self.delay_s:
                time.sleep(self.delay_s)
            with self._cond:
                self.raw[method].append(request)
                self._cond.notify_all()
            return b""

        return handle

    def decoded(self, method: str) -> list[Any]:
        with self._cond:
            return [PARSERS[method].FromString(b) for b in self.raw[method]]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def resources(self, method: str = METRICS_EXPORT) -> int:
        """Resource entries received: one per client request, however calls were merged."""
        total = 0
        for req in self.decoded(method):
            for field in ("resource_metrics", "resource_spans", "resource_logs"):
                if hasattr(req, field):
                    total += len(getattr(req, field))
        return total

    def log_records(self) -> list[Any]:
        out = []
        for req in self.decoded(LOGS_EXPORT):
            for rl in req.resource_logs:
                for sl in rl.scope_logs:
                    out.extend(sl.log_records)
        return out

    def alerts(self) -> list[Any]:
        return [r for r in self.log_records() if r.event_name == "otel_gpu.alert"]

    def metric_points(self, name: str) -> list[Any]:
        out = []
        for req in self.decoded(METRICS_EXPORT):
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            out.extend(m.gauge.data_points or m.sum.data_points)
        return out

    def close(self) -> None:
        self.server.stop(0).wait(2)


def call(
    target: str,
    method: str,
    payload: bytes,
    *,
    metadata=None,
    timeout=5.0,
    channel=None,
    compression=None,
):  # type: ignore[no-untyped-def]
    """Send raw bytes to ``method``; returns (response bytes, call) or raises grpc.RpcError."""
    own = channel is None
    ch = channel or grpc.insecure_channel(target)
    try:
        stub = ch.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)
        return stub.with_call(payload, metadata=metadata, timeout=timeout, compression=compression)
    finally:
        if own:
            ch.close()


@contextmanager
def receiver(delay_s: float = 0.0) -> Iterator[Receiver]:
    """A :class:`Receiver` for the ``with`` block, closed after it."""
    r = Receiver(delay_s)
    try:
        yield r
    finally:
        r.close()
