"""Metric export of the agent: OTLP gRPC (configured by the standard ``OTEL_*`` variables),
console, a Prometheus scrape endpoint, any of them together, or none.

Shutdown is bounded (:mod:`otel_gpu.core.shutdown`): the SDK's OTLP exporter retries for up to
its timeout per export, and a shutdown with the collector down took tens of seconds with
defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from otel_gpu.agent.selfmetrics import CountingExporter, ExportHealth
from otel_gpu.agent.settings import Settings
from otel_gpu.core.errors import UsageError
from otel_gpu.core.otlp import (
    HTTP_EXTRA,
    HTTP_PROTOBUF,
    otlp_protocol,
    protocol_variable,
    shown_endpoint,
)
from otel_gpu.core.prometheus import ScrapeEndpoint


def metric_readers(
    settings: Settings,
    env: Mapping[str, str] | None = None,
    export_health: ExportHealth | None = None,
) -> list[MetricReader]:
    """One reader per name in ``settings.exporter``; none for ``none``. With ``export_health``,
    every push export's outcome is counted there (self-metrics, ``/healthz``)."""
    interval_ms = settings.export_interval_s * 1000.0

    def counted(exporter: MetricExporter) -> MetricExporter:
        if export_health is None:
            return exporter
        export_health.pushing()
        return CountingExporter(exporter, export_health)

    readers: list[MetricReader] = []
    for name in settings.exporters:
        if name == "console":
            readers.append(
                PeriodicExportingMetricReader(counted(ConsoleMetricExporter()), interval_ms)
            )
        elif name == "otlp":
            readers.append(
                PeriodicExportingMetricReader(
                    counted(_otlp_exporter(settings, export_health, env)),
                    interval_ms,
                    export_timeout_millis=settings.export_timeout_s * 1000.0,
                )
            )
        elif name == "prometheus":
            readers.append(ScrapeEndpoint.from_env(os.environ if env is None else env))
    return readers


def _otlp_exporter(
    settings: Settings, export_health: ExportHealth | None, env: Mapping[str, str] | None = None
) -> MetricExporter:
    """The SDK's OTLP exporter for the protocol ``OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL`` asks
    (gRPC by default, or HTTP/protobuf), its problems reported once per episode and, over gRPC,
    the points a collector rejects in a partial success counted
    (``otel_gpu.agent.export.rejected_points``). Over gRPC each series' attributes are encoded
    once, not at every export (otel_gpu/agent/encode.py)."""
    from otel_gpu.agent.encode import cached_otlp_exporter_class
    from otel_gpu.core.export_log import EpisodeReportingExporter, PartialSuccessReport

    env = os.environ if env is None else env
    if otlp_protocol(env, "metrics") == HTTP_PROTOBUF:
        return _otlp_http_exporter(settings, env)
    kwargs: dict[str, object] = {"timeout": settings.export_timeout_s}
    if settings.endpoint:
        kwargs["endpoint"] = settings.endpoint
    try:
        exporter = cached_otlp_exporter_class()(**kwargs)
    except Exception as exc:  # e.g. OTEL_EXPORTER_OTLP_COMPRESSION=zstd, a bad header
        raise UsageError(
            f"cannot configure the OTLP exporter from the OTEL_EXPORTER_OTLP_* settings: {exc}"
        ) from None
    what = f"metric export to {shown_endpoint(settings.endpoint)}"
    PartialSuccessReport(
        what, export_health.record_rejected if export_health is not None else None
    ).attach(exporter)
    return EpisodeReportingExporter(exporter, what)


def _otlp_http_exporter(settings: Settings, env: Mapping[str, str]) -> MetricExporter:
    """OTLP over HTTP/protobuf; ``--endpoint`` is the collector's base URL (``/v1/metrics`` is
    added when it has no path), as ``OTEL_EXPORTER_OTLP_ENDPOINT`` is."""
    from otel_gpu.core.export_log import EpisodeReportingExporter

    variable = protocol_variable(env, "metrics")
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HttpExporter,
        )
    except ImportError:
        raise UsageError(
            f"{variable}=http/protobuf: the OTLP/HTTP exporter is not installed; "
            f"{HTTP_EXTRA}, or use grpc"
        ) from None
    kwargs: dict[str, object] = {"timeout": settings.export_timeout_s}
    if settings.endpoint:
        base = settings.endpoint if "://" in settings.endpoint else f"http://{settings.endpoint}"
        kwargs["endpoint"] = (
            base if urlsplit(base).path.strip("/") else f"{base.rstrip('/')}/v1/metrics"
        )
    try:
        exporter = HttpExporter(**kwargs)  # type: ignore[arg-type]
    except Exception as exc:
        raise UsageError(
            f"cannot configure the OTLP/HTTP exporter from the OTEL_EXPORTER_OTLP_* settings: {exc}"
        ) from None
    return EpisodeReportingExporter(
        exporter, f"metric export to {shown_endpoint(settings.endpoint)}"
    )


def meter_provider(
    settings: Settings,
    resource: Resource | None = None,
    extra_readers: Sequence[MetricReader] = (),
    export_health: ExportHealth | None = None,
) -> MeterProvider:
    readers = [*metric_readers(settings, export_health=export_health), *extra_readers]
    # Shut down once, by the command, within its bound (no second, unbounded call at exit).
    return MeterProvider(
        metric_readers=readers, resource=resource or Resource.create(), shutdown_on_exit=False
    )
