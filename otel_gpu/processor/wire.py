"""OTLP on the wire: service paths, shallow message views and gRPC status details.

The processor forwards the request bytes it received, so it never needs a full parse. It reads
requests through *views*: messages declared here with the same field numbers as OTLP but with
every part the processor does not read typed as ``bytes`` (kept as an opaque slice, not parsed)
or left out (skipped by the parser as an unknown field). Parsing a view checks the wire framing
of the levels it declares and costs a fraction of a full parse; a metric's data points are only
read when the metric is one the detectors use, each as its encoded bytes (see decode.py).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
LOGS_SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"
HEALTH_SERVICE = "grpc.health.v1.Health"

METRICS_EXPORT = f"/{METRICS_SERVICE}/Export"
TRACE_EXPORT = f"/{TRACE_SERVICE}/Export"
LOGS_EXPORT = f"/{LOGS_SERVICE}/Export"

# grpc.health.v1.HealthCheckResponse{status: SERVING=1 | NOT_SERVING=2}, encoded by hand: the
# message is one enum field and grpcio-health-checking is not a dependency.
HEALTH_SERVING = b"\x08\x01"
HEALTH_NOT_SERVING = b"\x08\x02"

_PKG = "otel_gpu.processor.view"
_F = descriptor_pb2.FieldDescriptorProto


def _build_views() -> dict[str, Any]:
    fd = descriptor_pb2.FileDescriptorProto(
        name="otel_gpu/processor/view.proto", package=_PKG, syntax="proto3"
    )

    def message(
        name: str, *fields: tuple[str, int, int, bool, str | None], oneof: str = ""
    ) -> None:
        m = fd.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name=oneof)
        for fname, number, ftype, repeated, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype)
            f.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            if type_name:
                f.type_name = f".{_PKG}.{type_name}"
            if oneof and fname in ("as_double", "as_int"):
                f.oneof_index = 0

    msg, byt, string = _F.TYPE_MESSAGE, _F.TYPE_BYTES, _F.TYPE_STRING
    # metrics: ExportMetricsServiceRequest > ResourceMetrics > ScopeMetrics > Metric
    message("MetricsRequest", ("resource_metrics", 1, msg, True, "ResourceMetrics"))
    message(
        "ResourceMetrics",
        ("resource", 1, byt, False, None),
        ("scope_metrics", 2, msg, True, "ScopeMetrics"),
    )
    message("ScopeMetrics", ("metrics", 2, msg, True, "Metric"))
    message(
        "Metric",
        ("name", 1, string, False, None),
        ("gauge", 5, byt, False, None),
        ("sum", 7, byt, False, None),
    )
    # Gauge and Sum both keep their points in field 1, each read as its bytes; a point that is
    # not in the usual layout is then parsed as a NumberDataPoint.
    # A Gauge has no fields 2 and 3; a Sum's aggregation_temporality stays an int (an unknown
    # value is kept, not lost) and is_monotonic a bool.
    message(
        "NumberDataRaw",
        ("data_points", 1, byt, True, None),
        ("aggregation_temporality", 2, _F.TYPE_INT32, False, None),
        ("is_monotonic", 3, _F.TYPE_BOOL, False, None),
    )
    message(
        "NumberDataPoint",
        ("attributes", 7, byt, True, None),
        ("start_time_unix_nano", 2, _F.TYPE_FIXED64, False, None),
        ("time_unix_nano", 3, _F.TYPE_FIXED64, False, None),
        ("as_double", 4, _F.TYPE_DOUBLE, False, None),
        ("as_int", 6, _F.TYPE_SFIXED64, False, None),
        oneof="value",
    )
    # Export*ServiceResponse: partial_success {rejected_<items> = 1, error_message = 2}, alike
    # for metrics, traces and logs.
    message(
        "PartialSuccess",
        ("rejected", 1, _F.TYPE_INT64, False, None),
        ("error_message", 2, string, False, None),
    )
    message("ExportResponse", ("partial_success", 1, msg, False, "PartialSuccess"))

    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    names = (
        "MetricsRequest",
        "NumberDataRaw",
        "NumberDataPoint",
        "ExportResponse",
    )
    return {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PKG}.{n}")) for n in names
    }


_VIEWS = _build_views()
MetricsRequestView: Any = _VIEWS["MetricsRequest"]
NumberDataRawView: Any = _VIEWS["NumberDataRaw"]
NumberDataPointView: Any = _VIEWS["NumberDataPoint"]
PartialSuccessView: Any = _VIEWS["ExportResponse"]


def retry_trailers(code_value: int, message: str, delay_s: float) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that tells a client when to retry.

    ``grpc-status-details-bin`` carries a google.rpc.Status with a RetryInfo detail (the gRPC
    standard, read by the OTel Collector and Go/Java exporters); ``google.rpc.retryinfo-bin``
    carries the bare RetryInfo, which is where the Python OTLP exporter (SDK 1.45) looks.
    """
    seconds = int(delay_s)
    delay = Duration(seconds=seconds, nanos=int(round((delay_s - seconds) * 1e9)))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code_value, message=message)
    status.details.add().Pack(info)
    return (
        ("grpc-status-details-bin", status.SerializeToString()),
        ("google.rpc.retryinfo-bin", info.SerializeToString()),
    )
