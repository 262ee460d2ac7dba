"""``otel-gpu processor --prometheus HOST:PORT``: the processor's outputs as a Prometheus
``/metrics`` endpoint, served by the OpenTelemetry Prometheus exporter (the agent's
:class:`otel_gpu.core.prometheus.ScrapeEndpoint`, private registry).

What it serves is exactly what the processor sends downstream as OTLP metrics: its detector
metrics (``otel_gpu.leak.rate``, ``otel_gpu.memory.time_to_exhaustion``,
``otel_gpu.breaker.state``, ``otel_gpu.alerts``; see outputs.py) and its own telemetry
(``otel_gpu.processor.*``; see telemetry.py). Each encoded request is published here by the
processor's tick thread as it is built, and replaces the previous one from the same source, so
a series the processor stopped sending (a leak that cleared) leaves ``/metrics`` with it.
Scrapes run on the HTTP server's threads; the instruments' callbacks only copy the last
published points under a lock (no parsing, no I/O).

Prometheus labels: each point's attributes (the subject's identity: ``otel_gpu_subject``,
``hw_id``, ``process_pid`` ...), plus the reporter's resource identity (``service_name``,
``service_instance_id``, ``host_name``, ``k8s_*``) where the point has no attribute of that
name; ``target_info`` holds the processor's own resource.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.metrics import (
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
)
from opentelemetry.sdk.resources import Resource

from otel_gpu import __version__
from otel_gpu.core.addresses import parse_hostport
from otel_gpu.core.prometheus import ScrapeEndpoint
from otel_gpu.core.shutdown import shutdown_provider
from otel_gpu.core.signals import COUNTER, GAUGE, UPDOWN, Signal, observable
from otel_gpu.processor.outputs import SCOPE_NAME

# Sources of published requests; each replaces only its own points.
DETECTOR = "detector"
TELEMETRY = "telemetry"
# Not a label from the reporter's resource: ``process_pid`` names the process a series is about
# (a process's GPU memory), and the reporting agent's own pid on a GPU's series would read as one.
_SUBJECT_KEYS = frozenset({"process.pid"})


def _plain(attrs: Any) -> dict[str, Any]:
    """OTLP KeyValues -> {key: str | int | float | bool}; arrays and maps are not labels."""
    out: dict[str, Any] = {}
    for kv in attrs:
        kind = kv.value.WhichOneof("value")
        if kind in ("string_value", "int_value", "double_value", "bool_value"):
            out[kv.key] = getattr(kv.value, kind)
    return out


class ProcessorScrape:
    """A ``/metrics`` endpoint on ``address`` (``HOST:PORT``) fed by :meth:`publish`.

    ``setting`` names what the user set (flag or variable) in the one-line error raised when
    the address cannot be served. At most ``max_series`` series per metric are served (the
    processor's own subject cap); the SDK folds any excess into one overflow series.
    """

    def __init__(self, address: str, setting: str, max_series: int = 20_000) -> None:
        host, port = parse_hostport(address, setting)
        limits = {
            kind: max_series
            for kind in (ObservableGauge, ObservableCounter, ObservableUpDownCounter)
        }
        shown = f"{setting} {address}" if setting.startswith("-") else f"{setting}={address}"
        self._endpoint = ScrapeEndpoint(
            host,
            port,
            setting=shown,
            fix=f"stop the other server or give {setting} a free port",
            cardinality_limits=limits,
        )
        self._provider = MeterProvider(
            metric_readers=[self._endpoint],
            resource=Resource.create({"service.name": "otel-gpu-processor"}),
            shutdown_on_exit=False,
        )
        self._meter = self._provider.get_meter(SCOPE_NAME, __version__)
        self._lock = threading.Lock()
        self._points: dict[str, dict[str, list[Observation]]] = {}
        self._instruments: set[str] = set()
        self.address = f"{self._endpoint.address[0]}:{self._endpoint.address[1]}"

    def publish(self, source: str, payload: bytes) -> None:
        """Serve the gauges and sums of one encoded ExportMetricsServiceRequest from now on, in
        place of the last one published under ``source``."""
        req = ExportMetricsServiceRequest.FromString(payload)
        points: dict[str, list[Observation]] = {}
        for rm in req.resource_metrics:
            reporter = {
                k: v for k, v in _plain(rm.resource.attributes).items() if k not in _SUBJECT_KEYS
            }
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    kind = metric.WhichOneof("data")
                    if kind not in ("gauge", "sum"):
                        continue  # the processor sends neither histograms nor summaries
                    data = getattr(metric, kind)
                    observed = points.setdefault(metric.name, [])
                    for dp in data.data_points:
                        value = dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double
                        observed.append(Observation(value, {**reporter, **_plain(dp.attributes)}))
                    self._declare(metric, kind)
        with self._lock:
            self._points[source] = points

    def _declare(self, metric: Any, kind: str) -> None:
        """Create the instrument of a metric name the first time it is published."""
        name = metric.name
        with self._lock:
            if name in self._instruments:
                return
            self._instruments.add(name)
        monotonic = kind == "sum" and metric.sum.is_monotonic
        served_kind = GAUGE if kind == "gauge" else COUNTER if monotonic else UPDOWN
        # Re-served as published (the contract's names, units and kinds: outputs.py,
        # telemetry.py), through the one guarded way instruments are made.
        served = Signal(name, served_kind, metric.unit, metric.description)
        observable(self._meter, served, [self._reader(name)])

    def _reader(self, name: str) -> Any:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                return [o for source in self._points.values() for o in source.get(name, ())]

        return observe

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving (bounded)."""
        shutdown_provider(self._provider, timeout_s)
