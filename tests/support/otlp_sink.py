"""An OTLP gRPC receiver for tests: real gRPC on 127.0.0.1, the servicers of opentelemetry-proto.

It keeps every request with the peer (client address) that sent it, so a test can tell which
process sent what, and flattens spans, metric points and log records with their resource.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            getattr(v, kind) if kind and kind not in ("array_value", "kvlist_value") else str(v)
        )
    return out


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    events: list[tuple[str, dict[str, Any]]]
    peer: str
    start_ns: int
    end_ns: int


@dataclass
class Point:
    metric: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    value: float
    time_ns: int
    peer: str


class OtlpSink:
    """Start with ``with OtlpSink() as sink:``; ``sink.endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, port: int = 0) -> None:
        self._lock = threading.Lock()
        self.trace_requests: list[tuple[str, Any]] = []
        self.metric_requests: list[tuple[str, Any]] = []
        self.log_requests: list[tuple[str, Any]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        sink = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                with sink._lock:
                    sink.trace_requests.append((context.peer(), request))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                with sink._lock:
                    sink.metric_requests.append((context.peer(), request))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                with sink._lock:
                    sink.log_requests.append((context.peer(), request))
                return logs_service_pb2.ExportLogsServiceResponse()

        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpSink:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop(grace=None)

    def spans(self) -> list[Span]:
        out = []
        with self._lock:
            requests = list(self.trace_requests)
        for peer, req in requests:
            for rs in req.resource_spans:
                resource = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(
                            Span(
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                attrs(s.attributes),
                                resource,
                                s.status.code,
                                [(e.name, attrs(e.attributes)) for e in s.events],
                                peer,
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                            )
                        )
        return out

    def points(self) -> list[Point]:
        out = []
        with self._lock:
            requests = list(self.metric_requests)
        for peer, req in requests:
            for rm in req.resource_metrics:
                resource = attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        for p in getattr(m, kind).data_points:
                            value = (
                                p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            )
                            out.append(
                                Point(
                                    m.name,
                                    attrs(p.attributes),
                                    resource,
                                    value,
                                    p.time_unix_nano,
                                    peer,
                                )
                            )
        return out

    def logs(self) -> list[tuple[str, dict[str, Any], dict[str, Any], str]]:
        """(body, attributes, resource, trace id hex) of every log record."""
        out = []
        with self._lock:
            requests = list(self.log_requests)
        for _peer, req in requests:
            for rl in req.resource_logs:
                resource = attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for r in sl.log_records:
                        out.append(
                            (r.body.string_value, attrs(r.attributes), resource, r.trace_id.hex())
                        )
        return out
