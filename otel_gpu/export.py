"""Metric export: OTLP gRPC (configured by the standard ``OTEL_*`` variables), console, a
Prometheus scrape endpoint, any of them together, or none.

Shutdown is bounded: the SDK's OTLP exporter retries for up to its timeout per export, and a
shutdown with the collector down took tens of seconds with defaults (FIELD-NOTES §2), so every
flush and shutdown here runs on a helper thread that is abandoned after ``timeout_s``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from otel_gpu.config import Settings
from otel_gpu.errors import UsageError
from otel_gpu.selfmetrics import CountingExporter, ExportHealth

log = logging.getLogger("otel_gpu.export")


# The standard variables of the OpenTelemetry Prometheus exporter, with its defaults.
PROMETHEUS_HOST_ENV = "OTEL_EXPORTER_PROMETHEUS_HOST"
PROMETHEUS_PORT_ENV = "OTEL_EXPORTER_PROMETHEUS_PORT"
PROMETHEUS_DEFAULT_HOST = "localhost"
PROMETHEUS_DEFAULT_PORT = 9464


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
    collector rejects in a partial success counted (``otel_gpu.agent.export.rejected_points``)."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    from otel_gpu.export_log import EpisodeReportingExporter, PartialSuccessReport

    kwargs: dict[str, object] = {"timeout": settings.export_timeout_s}
    if settings.endpoint:
        kwargs["endpoint"] = settings.endpoint
    try:
        exporter = OTLPMetricExporter(**kwargs)  # type: ignore[arg-type]
    except Exception as exc:  # e.g. OTEL_EXPORTER_OTLP_COMPRESSION=zstd, a bad header
        raise UsageError(
            f"cannot configure the OTLP exporter from the OTEL_EXPORTER_OTLP_* settings: {exc}"
        ) from None
    what = f"metric export to {shown_endpoint(settings.endpoint)}"
    PartialSuccessReport(
        what, export_health.record_rejected if export_health is not None else None
    ).attach(exporter)
    return EpisodeReportingExporter(exporter, what)


def shown_endpoint(endpoint: str | None) -> str:
    """The OTLP endpoint as logs and the view show it: scheme, host and port only (a URL may
    carry credentials in its user part or its query)."""
    from urllib.parse import urlsplit

    url = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


SCRAPE_WORKERS = 8  # scrapes served at once (Prometheus replicas, a curl); more are closed
SCRAPE_TIMEOUT_S = 5.0  # per socket read or write: a client that stalls is dropped


class ScrapeEndpoint(PrometheusMetricReader):
    """``GET /metrics`` for Prometheus, served by the OpenTelemetry Prometheus exporter.

    Each scrape collects on the HTTP server's own thread; the instruments' callbacks only read
    the sampler's last snapshot, so a scrape never touches NVML or /proc. A private registry
    keeps prometheus_client's default process and GC collectors (the agent's own process)
    out of the job's series.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        setting: str = f"{PROMETHEUS_HOST_ENV} / {PROMETHEUS_PORT_ENV}",
        fix: str = f"choose a free port with {PROMETHEUS_PORT_ENV}",
        **reader_options: Any,
    ) -> None:
        """Serve on ``host:port``; a failure to bind is a UsageError naming ``setting`` (what
        the user set) and ``fix``. ``reader_options`` go to PrometheusMetricReader."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import MetricsHandler

        from otel_gpu.health import BoundedServer

        registry = CollectorRegistry(auto_describe=True)
        super().__init__(registry=registry, **reader_options)
        # Not prometheus_client's start_http_server: it gives every connection a thread with no
        # timeout, so idle or slow clients pile up threads in the agent (or the job's process).
        handler = type(
            "ScrapeHandler", (MetricsHandler.factory(registry),), {"timeout": SCRAPE_TIMEOUT_S}
        )
        try:
            self._server = BoundedServer((host, port), handler, SCRAPE_WORKERS)
        except OSError as exc:  # port taken, address not on this host, unknown host name
            # ``fix`` is about the port; a host that is not this machine's needs another one.
            taken = exc.errno in (errno.EADDRINUSE, errno.EACCES)
            raise UsageError(
                f"cannot serve Prometheus metrics on {host}:{port} "
                f"({setting}): {exc.strerror or exc}; "
                f"{fix if taken else 'give an address of this host, e.g. 127.0.0.1 or 0.0.0.0'}"
            ) from None
        self.address = (host, self._server.server_port)
        threading.Thread(
            target=self._server.serve_forever, name="otel-gpu-prometheus", daemon=True
        ).start()
        log.info("serving Prometheus metrics at http://%s:%d/metrics", *self.address)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ScrapeEndpoint:
        host = env.get(PROMETHEUS_HOST_ENV, "").strip() or PROMETHEUS_DEFAULT_HOST
        raw = env.get(PROMETHEUS_PORT_ENV, "").strip() or str(PROMETHEUS_DEFAULT_PORT)
        try:
            port = int(raw)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise UsageError(
                f"{PROMETHEUS_PORT_ENV}={raw!r} is not a TCP port: use 1-65535 "
                f"(default {PROMETHEUS_DEFAULT_PORT})"
            )
        return cls(host, port)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        super().shutdown(timeout_millis, **kwargs)
        self._server.shutdown()
        self._server.server_close()


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


def close_all(steps: Sequence[tuple[str, Callable[[float], object]]], timeout_s: float) -> bool:
    """Run every ``step(timeout_s)`` in parallel and wait for them until one shared deadline.

    One bound for the whole shutdown (``OTEL_GPU_SHUTDOWN_TIMEOUT``), not one per step: steps
    that overrun are abandoned on their daemon threads. True if all finished in time.
    """
    deadline = time.monotonic() + timeout_s
    threads = []
    for name, step in steps:
        thread = threading.Thread(
            target=_quietly,
            args=(name, step, timeout_s),
            name=f"otel-gpu-close-{name}",
            daemon=True,
        )
        thread.start()
        threads.append((name, thread))
    late = []
    for name, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            late.append(name)
    if late:
        log.warning("shutdown of %s did not finish within %.1f s", ", ".join(late), timeout_s)
    return not late


def _quietly(name: str, step: Callable[[float], object], timeout_s: float) -> None:
    try:
        step(timeout_s)
    except Exception:
        log.debug("%s shutdown failed", name, exc_info=True)


def shutdown_provider(provider: MeterProvider, timeout_s: float) -> bool:
    """Flush and shut down within ``timeout_s`` seconds, whatever the collector does."""
    timeout_ms = max(1.0, timeout_s * 1000.0)
    return bounded(
        lambda: provider.shutdown(timeout_millis=timeout_ms), timeout_s, "metric shutdown"
    )


def default_service_name(command: Sequence[str] | None = None) -> str:
    """The service name the environment gives (``OTEL_SERVICE_NAME``, else ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``), else the watched command's program name."""
    from otel_gpu.job_identity import given_service_name

    name = given_service_name(os.environ)
    if name:
        return name
    return program_name(command or ()) or "otel-gpu"


# Programs that only launch the one that names the job: `opentelemetry-instrument python -u
# train.py` is the job "train", not "opentelemetry-instrument".
_LAUNCHERS = frozenset({"opentelemetry-instrument", "env", "nohup", "time", "exec"})
_PYTHON = re.compile(r"^python[0-9.]*$")


def program_name(command: Sequence[str]) -> str:
    """The name of the program a command runs, past launchers and the interpreter: the script's
    stem (``train`` for ``python train.py``), the module (``python -m swift.cli.sft``) or the
    program itself (``swift``, ``torchrun``; ``python`` for ``python -c CODE``: code is no name,
    and may hold anything)."""
    words = list(command)
    while words and (os.path.basename(words[0]) in _LAUNCHERS or "=" in words[0]):
        words.pop(0)  # a launcher, or one of env's NAME=value words
        while words and words[0].startswith("-"):
            words.pop(0)  # the launcher's own flags (time -p, env -i)
    if not words:
        return ""
    name = os.path.basename(words[0])
    if _PYTHON.match(name):
        return _python_target(name, words[1:])
    return name.removesuffix(".py") or name


# The interpreter's options whose value follows, in the same word (-Wignore) or the next.
_PYTHON_VALUE_OPTIONS = "cmWX"


def _python_target(interpreter: str, args: Sequence[str]) -> str:
    """What ``interpreter args`` runs: the script's stem, the ``-m`` module, else (``-c``,
    standard input, nothing) the interpreter's own name."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        word = args[i]
        i += 1
        if word.startswith("--"):  # --version and the like: no value
            continue
        for at, letter in enumerate(word[1:], start=2):
            if letter in _PYTHON_VALUE_OPTIONS:
                value = word[at:]
                if not value and i < len(args):
                    value, i = args[i], i + 1
                if letter == "m":
                    return value or interpreter
                if letter == "c":
                    return interpreter
                break  # -W / -X: their value is no program
    if i == len(args) or args[i] == "-":
        return interpreter
    script = os.path.basename(args[i])
    return script.removesuffix(".py") or script
