"""A strict downstream OTLP gRPC server for the processor tests: it decodes every request in
full with opentelemetry-proto (a body that does not parse is refused, as a real backend does),
can refuse requests holding a marked resource, report ``partial_success``, or be down."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT, TRACE_EXPORT

PARSERS: dict[str, Any] = {
    METRICS_EXPORT: ExportMetricsServiceRequest,
    TRACE_EXPORT: ExportTraceServiceRequest,
    LOGS_EXPORT: ExportLogsServiceRequest,
}
REJECT_KEY = "test.reject"  # a resource attribute this downstream refuses (INVALID_ARGUMENT)


def resource_attrs(rm: Any) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in rm.resource.attributes}


class StrictDownstream:
    """``resources[method]`` counts every resource received, by its ``service.instance.id``."""

    def __init__(self, port: int = 0, *, partial_rejected: int = 0) -> None:
        self.resources: dict[str, Counter[str]] = {m: Counter() for m in PARSERS}
        self.requests: list[Any] = []  # every metrics request accepted, decoded
        self.calls = 0
        self.refused = 0
        self.partial_rejected = partial_rejected
        self._cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for method, parser in PARSERS.items():
            service, _, name = method.lstrip("/").rpartition("/")
            handlers.setdefault(service, {})[name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method),
                request_deserializer=parser.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(s, h) for s, h in handlers.items()]
        )
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def _handler(self, method: str) -> Callable[[Any, Any], Any]:
        def handle(request: Any, context: Any) -> Any:
            items = list(
                getattr(request, "resource_metrics", None)
                or getattr(request, "resource_spans", None)
                or getattr(request, "resource_logs", None)
                or ()
            )
            with self._cond:
                self.calls += 1
                if any(REJECT_KEY in resource_attrs(rm) for rm in items):
                    self.refused += 1
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "marked resource refused")
                if method == METRICS_EXPORT:
                    self.requests.append(request)
                for rm in items:
                    self.resources[method][resource_attrs(rm).get("service.instance.id", "")] += 1
                self._cond.notify_all()
            if method == METRICS_EXPORT:
                return ExportMetricsServiceResponse(
                    partial_success=ExportMetricsPartialSuccess(
                        rejected_data_points=self.partial_rejected,
                        error_message="too old" if self.partial_rejected else "",
                    )
                )
            return (
                ExportTraceServiceResponse()
                if method == TRACE_EXPORT
                else ExportLogsServiceResponse()
            )

        return handle

    def decoded(self) -> list[Any]:
        with self._cond:
            return list(self.requests)

    def count(self, instance: str, method: str = METRICS_EXPORT) -> int:
        with self._cond:
            return self.resources[method][instance]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self) -> None:
        self.server.stop(0).wait(2)
