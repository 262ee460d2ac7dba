"""The SDK pipeline of a training process: providers, exporters, bounded shutdown.

Imported by the configurator only in ``trainer`` and ``node`` processes (launchers never pay
for the SDK). Exporters come from the standard ``OTEL_{TRACES,METRICS,LOGS}_EXPORTER``
variables and their entry points, and read their own ``OTEL_EXPORTER_OTLP_*`` settings.

Shutdown is bounded by ``OTEL_GPU_SHUTDOWN_TIMEOUT`` (default 5 s) even with the collector
down: the agent and the three providers are flushed in parallel on daemon threads that are
abandoned at the deadline (:mod:`otel_gpu.core.shutdown`; the SDK's own exit handlers took
~43 s in that case).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry._logs import set_logger_provider
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.util._importlib_metadata import entry_points

from otel_gpu.core.errors import UsageError
from otel_gpu.core.otlp import (
    HTTP_EXTRA,
    HTTP_PROTOBUF,
    check_otlp_environment,
    otlp_protocol,
    protocol_variable,
)
from otel_gpu.core.redact import COMMAND_REDACTED
from otel_gpu.core.redact_sdk import RedactingLogProcessor, redact_resource
from otel_gpu.core.shutdown import close_all
from otel_gpu.tracing import collective_timing as timing
from otel_gpu.tracing import context, ids, inprocess, memory_ops, progress

log = logging.getLogger("otel_gpu.distro")


class Setup:
    """What :func:`configure` built in this process."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.tracer_provider: TracerProvider | None = None
        self.meter_provider: MeterProvider | None = None
        self.logger_provider: LoggerProvider | None = None
        self.agent: Any = None
        self.shutdown_timeout_s = 5.0
        self.closed = False


def build(
    role: str,
    auto_instrumentation_version: str | None = None,
    *,
    shutdown_timeout_s: float = 5.0,
    process_command: str = COMMAND_REDACTED,
    collective_timing: bool = True,
) -> Setup:
    """Providers, exporters and training instruments, set as the global ones. The node agent
    of a ``node`` process is composed by :mod:`otel_gpu.distro`, which sets ``Setup.agent``.
    ``process_command``: what the resource's command attributes hold (``OTEL_GPU_PROCESS_COMMAND``);
    ``collective_timing``: time torch.distributed's collectives (``OTEL_GPU_COLLECTIVE_TIMING``)."""
    setup = Setup(role)
    setup.shutdown_timeout_s = shutdown_timeout_s
    progress.mark_load_started()
    if context.is_training_command(sys.orig_argv):
        progress.expect_training()
    attributes: dict[str, Any] = {"process.pid": os.getpid()}
    if auto_instrumentation_version:
        attributes["telemetry.auto.version"] = auto_instrumentation_version
    resource = redact_resource(Resource.create(attributes), process_command)

    tracer_provider = TracerProvider(
        resource=resource, id_generator=ids.PresetIdGenerator(), shutdown_on_exit=False
    )
    for exporter in _exporters("traces"):
        tracer_provider.add_span_processor(BatchSpanProcessor(_quiet(exporter, "trace")))
    # `prometheus` is a reader serving /metrics itself (core/prometheus.py); its HTTP thread
    # does not survive fork(), so a forked worker exports nothing through it.
    readers: list[MetricReader] = [
        exporter
        if isinstance(exporter, MetricReader)
        else PeriodicExportingMetricReader(_OwnerOnly(_quiet(exporter, "metric")))
        for exporter in _exporters("metrics")
    ]
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, shutdown_on_exit=False
    )
    logger_provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    logger_provider.add_log_record_processor(RedactingLogProcessor())  # before any exporter
    for exporter in _exporters("logs"):
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(_quiet(exporter, "log")))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    set_logger_provider(logger_provider)
    setup.tracer_provider, setup.meter_provider = tracer_provider, meter_provider
    setup.logger_provider = logger_provider

    progress.register(meter_provider)
    _hook_torch(meter_provider)
    timing.hook(collective_timing)  # training.step.work / .collective_wait, once torch loads
    inprocess.serve()  # what otel-gpu may ask this process (docs/inprocess.md)
    memory_ops.register()  # memory.census: leak attribution, `otel-gpu diagnose memory`
    atexit.register(shutdown, setup)
    return setup


def _hook_torch(meter_provider: MeterProvider) -> None:
    import wrapt

    wrapt.register_post_import_hook(
        lambda torch: progress.register_torch(torch, meter_provider), "torch"
    )


def exporter_entry_point(name: str, signal: str) -> str:
    """``otlp`` -> ``otlp_proto_grpc`` (or ``otlp_proto_http`` when the protocol says so)."""
    if name != "otlp":
        return name
    protocol = otlp_protocol(os.environ, signal)
    return "otlp_proto_http" if protocol == HTTP_PROTOBUF else "otlp_proto_grpc"


def _quiet(exporter: Any, signal: str) -> Any:
    """An OTLP exporter whose failures are reported once per episode (one line when the
    collector goes away, a count now and then, one on recovery) instead of the SDK's retry
    blocks in the job's output, as the otel-gpu commands do (core/export_log.py)."""
    if "otlp" not in type(exporter).__module__:
        return exporter
    from otel_gpu.core.export_log import EpisodeReportingExporter, EpisodeReportingSignalExporter
    from otel_gpu.core.otlp import shown_endpoint

    what = f"otel-gpu: {signal} export to {shown_endpoint(_signal_endpoint(signal))}"
    if isinstance(exporter, MetricExporter):
        return EpisodeReportingExporter(exporter, what)
    return EpisodeReportingSignalExporter(exporter, what)


def _signal_endpoint(signal: str) -> str | None:
    specific = {"trace": "TRACES", "metric": "METRICS", "log": "LOGS"}[signal]
    return os.environ.get(f"OTEL_EXPORTER_OTLP_{specific}_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )


def _exporters(signal: str) -> list[Any]:
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    names = [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]
    out = []
    for name in names:
        if name.lower() == "none":
            continue
        group = f"opentelemetry_{signal}_exporter"
        if signal == "metrics" and name.lower() == "prometheus":
            # Not the SDK's reader: it serves on prometheus_client's server, a thread per
            # connection with no timeout, and a client that resets prints a traceback on the
            # job's terminal each time. The agent's bounded endpoint reads the same variables.
            from otel_gpu.core.prometheus import ScrapeEndpoint  # only when asked: ~30 ms

            out.append(ScrapeEndpoint.from_env(os.environ))
            continue
        if name.lower() == "otlp":
            # A malformed header list would be logged in full by the SDK and the exports would
            # go without it: refused here (one line, masked), telemetry off in this process.
            check_otlp_environment(os.environ)
        found = list(entry_points(group=group, name=exporter_entry_point(name, signal)))
        if not found and exporter_entry_point(name, signal) == "otlp_proto_http":
            raise UsageError(
                f"{protocol_variable(os.environ, signal)}=http/protobuf: the OTLP/HTTP exporter "
                f"is not installed; {HTTP_EXTRA}, or use grpc"
            )
        if not found:
            installed = sorted({"otlp", *entry_points(group=group).names})
            raise UsageError(
                f"{variable}={name!r}: no such exporter is installed; use one of {', '.join(installed)}"
            )
        out.append(found[0].load()())
    return out


class _OwnerOnly(MetricExporter):
    """Exports only from the process that configured it.

    After ``fork()`` the SDK restarts the metric reader's thread in the child (docs/background.md §2),
    which would send the parent's series again under the parent's resource from every
    DataLoader worker. The child's exports are dropped here.
    """

    def __init__(self, exporter: MetricExporter) -> None:
        super().__init__(
            preferred_temporality=exporter._preferred_temporality,
            preferred_aggregation=exporter._preferred_aggregation,
        )
        self._exporter = exporter
        self._owner_pid = os.getpid()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if os.getpid() != self._owner_pid:
            return MetricExportResult.SUCCESS
        return self._exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return os.getpid() != self._owner_pid or self._exporter.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs)


def shutdown(setup: Setup) -> None:
    """Flush and stop everything within ``setup.shutdown_timeout_s`` in total."""
    if os.getpid() != _configured_pid:
        return  # a forked child: the parent owns the exporters
    if setup.closed:
        return  # otel_gpu.init()'s context manager closed it before the interpreter's exit
    setup.closed = True
    timeout_s = setup.shutdown_timeout_s
    timeout_ms = timeout_s * 1000
    steps: list[tuple[str, Callable[[float], object]]] = []
    if setup.agent is not None:
        steps.append(("agent", lambda t: setup.agent.shutdown(t)))
    if setup.tracer_provider is not None:
        steps.append(("traces", lambda _t: setup.tracer_provider.shutdown()))  # type: ignore[union-attr]
    if setup.meter_provider is not None:
        steps.append(("metrics", lambda _t: _shutdown_meters(setup, timeout_ms)))
    if setup.logger_provider is not None:
        steps.append(("logs", lambda _t: setup.logger_provider.shutdown()))  # type: ignore[union-attr]
    if not close_all(steps, timeout_s):
        log.warning("otel-gpu: telemetry not fully flushed at exit (collector unreachable?)")


def _shutdown_meters(setup: Setup, timeout_ms: float) -> None:
    """Shut the meter provider down once the agent (built on its own thread) has its meter: a
    provider shut down under a building agent logs "A shutdown MeterProvider can not provide
    a Meter" in every short job."""
    if setup.agent is not None:
        setup.agent.wait_started(setup.shutdown_timeout_s)
    setup.meter_provider.shutdown(timeout_millis=timeout_ms)  # type: ignore[union-attr]


_configured_pid = os.getpid()
