"""OTLP encoding of the agent's metrics, with each series' attributes encoded once.

The SDK's encoder (``opentelemetry.exporter.otlp.proto.common.metrics_encoder``) builds every
attribute of every point anew at each export: a protobuf ``KeyValue`` and ``AnyValue`` per
attribute, in Python. The agent exports about 800 points every interval whose attributes are the
same from one export to the next (the instruments hand the SDK one cached attribute dict per
series, and the SDK keeps the dict of a series' first measurement), so :class:`MetricsEncoder`
keeps each dict's encoded list between exports (by identity, holding the dict itself so its id
cannot be reused, and only for dicts the last export used) and lets protobuf copy it in C.

It writes the same message as the SDK's encoder (a test compares them); anything it does not
handle the same way (histograms, exemplars, a value of another type) goes to the SDK's encoder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb2
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.sdk.metrics.export import Gauge, MetricsData, Sum


class _Unhandled(Exception):
    """Something this encoder leaves to the SDK's."""


def _any_value(value: object) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, (tuple, list)):  # string[] and the like (resource attributes)
        return AnyValue(array_value=ArrayValue(values=[_any_value(v) for v in value]))
    raise _Unhandled


class MetricsEncoder:
    """``encode(data)``: the export request for ``data``; one per exporter (not thread-safe:
    the SDK exports from one thread at a time)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Any, pb2.NumberDataPoint]] = {}
        self._used: dict[int, tuple[Any, pb2.NumberDataPoint]] = {}

    def encode(self, data: MetricsData) -> ExportMetricsServiceRequest:
        self._used = {}
        try:
            request = self._encode(data)
        except _Unhandled:
            request = encode_metrics(data)
        self._cache = self._used  # series gone since the last export are forgotten
        return request

    def _attributes(self, attrs: Mapping[str, Any] | None) -> list[KeyValue]:
        return list(self._template(attrs).attributes) if attrs else []

    def _template(self, attrs: Mapping[str, Any] | None) -> pb2.NumberDataPoint:
        """A data point holding only ``attrs``, encoded once per series."""
        key = id(attrs)
        entry = self._used.get(key) or self._cache.get(key)
        if entry is None or entry[0] is not attrs:
            kvs = [KeyValue(key=k, value=_any_value(v)) for k, v in (attrs or {}).items()]
            entry = (attrs, pb2.NumberDataPoint(attributes=kvs))
        self._used[key] = entry
        return entry[1]

    def _encode(self, data: MetricsData) -> ExportMetricsServiceRequest:
        resources = []
        for rm in data.resource_metrics:
            resource = Resource(attributes=self._attributes(rm.resource.attributes))  # first:
            scopes = []  # a value left to the SDK's encoder is found before the points' work
            for sm in rm.scope_metrics:
                scope = sm.scope
                metrics = [self._metric(m) for m in sm.metrics]
                scopes.append(
                    pb2.ScopeMetrics(
                        scope=InstrumentationScope(
                            name=scope.name,
                            version=scope.version or "",
                            attributes=self._attributes(scope.attributes),
                        ),
                        schema_url=scope.schema_url or "",
                        metrics=metrics,
                    )
                )
            resources.append(
                pb2.ResourceMetrics(
                    resource=resource,
                    scope_metrics=scopes,
                    schema_url=rm.resource.schema_url,
                )
            )
        return ExportMetricsServiceRequest(resource_metrics=resources)

    def _metric(self, metric: Any) -> pb2.Metric:
        data = metric.data
        is_sum = isinstance(data, Sum)
        if not (is_sum or isinstance(data, Gauge)):
            raise _Unhandled
        out = pb2.Metric(name=metric.name, description=metric.description, unit=metric.unit)
        if not data.data_points:  # as the SDK's encoder: a metric without points has no data
            return out
        if is_sum:
            out.sum.aggregation_temporality = data.aggregation_temporality
            out.sum.is_monotonic = data.is_monotonic
            points = out.sum.data_points
        else:
            points = out.gauge.data_points
        template = self._template
        for dp in data.data_points:
            if dp.exemplars:
                raise _Unhandled
            value = dp.value
            pt = points.add()
            pt.MergeFrom(template(dp.attributes))
            pt.time_unix_nano = dp.time_unix_nano
            if is_sum:
                pt.start_time_unix_nano = dp.start_time_unix_nano
            if isinstance(value, int):
                pt.as_int = value
            elif isinstance(value, float):
                pt.as_double = value
            else:
                raise _Unhandled
        return out


def cached_otlp_exporter_class() -> type:
    """The SDK's OTLP gRPC metric exporter, encoding with :class:`MetricsEncoder`."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    class CachedEncodingOTLPMetricExporter(OTLPMetricExporter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._encoder = MetricsEncoder()

        def _translate_data(self, data: MetricsData) -> ExportMetricsServiceRequest:  # type: ignore[override]
            return self._encoder.encode(data)

    return CachedEncodingOTLPMetricExporter
