"""OTLP collectors that answer as scripted (retry, refuse, partial success, slow)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc


@dataclass(frozen=True)
class Refusal:
    """An answer: this gRPC status, with a RetryInfo delay when ``retry_after_s`` is set."""

    code: grpc.StatusCode
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Partial:
    """An answer: accepted, but ``rejected`` points refused (OTLP partial_success)."""

    rejected: int
    message: str


@dataclass
class ScriptedCollector:
    """A real OTLP gRPC metrics receiver that answers the n-th request with ``answers[n]``
    (the last answer repeats) and keeps every request with its arrival time (monotonic)."""

    answers: list[Refusal | Partial | None]
    delay_s: float = 0.0  # before answering (a slow collector)
    arrivals: list[float] = field(default_factory=list)
    requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(default_factory=list)

    def export(self, request, context):  # the servicer's Export
        n = len(self.arrivals)
        self.arrivals.append(time.monotonic())
        self.requests.append(request)
        if self.delay_s:
            time.sleep(self.delay_s)
        answer = self.answers[min(n, len(self.answers) - 1)]
        if answer is None:
            return metrics_service_pb2.ExportMetricsServiceResponse()
        if isinstance(answer, Partial):
            reply = metrics_service_pb2.ExportMetricsServiceResponse()
            reply.partial_success.rejected_data_points = answer.rejected
            reply.partial_success.error_message = answer.message
            return reply
        if answer.retry_after_s is not None:
            whole = int(answer.retry_after_s)
            delay = Duration(seconds=whole, nanos=int((answer.retry_after_s - whole) * 1e9))
            info = RetryInfo(retry_delay=delay).SerializeToString()
            context.set_trailing_metadata((("google.rpc.retryinfo-bin", info),))
        context.abort(answer.code, "scripted refusal")


@contextmanager
def serving(collector: ScriptedCollector) -> Iterator[str]:
    """Serve ``collector`` over plain (insecure) gRPC; yields its ``http://`` endpoint."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):  # noqa: N802 (gRPC's naming)
            return collector.export(request, context)

    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
