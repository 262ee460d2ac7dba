"""Metric export of the agent: OTLP gRPC (configured by the standard ``OTEL_*`` variables),
console, a Prometheus scrape endpoint, any of them together, or none.

Shutdown is bounded (:mod:`otel_gpu.core.shutdown`): the SDK's OTLP exporter retries for up to
its timeout per export, and a shutdown with the collector down took tens of seconds with
defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

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
from otel_gpu.core.otlp import shown_endpoint
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
        return exporter if export_health is None else CountingExporter(exporter, export_health)

    readers: list[MetricReader] = []
    for name in settings.exporters:
        if name == "console":
            readers.append(
                PeriodicExportingMetricReader(counted(ConsoleMetricExporter()), interval_ms)
            )
        elif name == "otlp":
            readers.append(
                PeriodicExportingMetricReader(
                    counted(_otlp_exporter(settings, export_health)),
                    interval_ms,
                    export_timeout_millis=settings.export_timeout_s * 1000.0,
                )
            )
        elif name == "prometheus":
            readers.append(ScrapeEndpoint.from_env(os.environ if env is None else env))
    return readers


def _otlp_exporter(settings: Settings, export_health: ExportHealth | None) -> MetricExporter:
    """The SDK's OTLP gRPC exporter, its problems reported once per episode and the points a
    collector rejects in a partial success counted (``otel_gpu.agent.export.rejected_points``).
    Each series' attributes are encoded once, not at every export (otel_gpu/agent/encode.py)."""
    from otel_gpu.agent.encode import cached_otlp_exporter_class
    from otel_gpu.core.export_log import EpisodeReportingExporter, PartialSuccessReport

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
