"""Metric export: OTLP gRPC (configured by the standard ``OTEL_*`` variables), console, or none.

Shutdown is bounded: the SDK's OTLP exporter retries for up to its timeout per export, and a
shutdown with the collector down took tens of seconds with defaults (FIELD-NOTES §2), so every
flush and shutdown here runs on a helper thread that is abandoned after ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from otel_gpu.config import Settings

log = logging.getLogger("otel_gpu.export")


def metric_readers(settings: Settings) -> list[MetricReader]:
    """Readers for ``settings.exporter``; none for ``none``."""
    interval_ms = settings.export_interval_s * 1000.0
    if settings.exporter == "console":
        return [PeriodicExportingMetricReader(ConsoleMetricExporter(), interval_ms)]
    if settings.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        kwargs: dict[str, object] = {"timeout": settings.export_timeout_s}
        if settings.endpoint:
            kwargs["endpoint"] = settings.endpoint
        exporter = OTLPMetricExporter(**kwargs)  # type: ignore[arg-type]
        return [
            PeriodicExportingMetricReader(
                exporter, interval_ms, export_timeout_millis=settings.export_timeout_s * 1000.0
            )
        ]
    return []


def meter_provider(
    settings: Settings,
    resource: Resource | None = None,
    extra_readers: Sequence[MetricReader] = (),
) -> MeterProvider:
    readers = [*metric_readers(settings), *extra_readers]
    return MeterProvider(metric_readers=readers, resource=resource or Resource.create())


def bounded(fn: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s``; True if it finished."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            log.debug("%s failed", what, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name=f"otel-gpu-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("%s did not finish within %.1f s; continuing without it", what, timeout_s)
        return False
    return True


def shutdown_provider(provider: MeterProvider, timeout_s: float) -> bool:
    """Flush and shut down within ``timeout_s`` seconds, whatever the collector does."""
    timeout_ms = max(1.0, timeout_s * 1000.0)
    return bounded(
        lambda: provider.shutdown(timeout_millis=timeout_ms), timeout_s, "metric shutdown"
    )


def default_service_name(command: Sequence[str] | None = None) -> str:
    """``OTEL_SERVICE_NAME`` when set, else the watched command's program name."""
    name = os.environ.get("OTEL_SERVICE_NAME")
    if name:
        return name
    if command:
        return os.path.basename(command[0]) or "otel-gpu"
    return "otel-gpu"
