"""A Prometheus ``/metrics`` endpoint served by the OpenTelemetry Prometheus exporter on the
project's bounded HTTP server: the agent's ``--exporter prometheus`` and the processor's
``--prometheus`` use this one implementation."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader

from otel_gpu.core.errors import UsageError
from otel_gpu.core.http import BoundedServer

log = logging.getLogger("otel_gpu.export")

# The standard variables of the OpenTelemetry Prometheus exporter, with its defaults.
PROMETHEUS_HOST_ENV = "OTEL_EXPORTER_PROMETHEUS_HOST"
PROMETHEUS_PORT_ENV = "OTEL_EXPORTER_PROMETHEUS_PORT"
PROMETHEUS_DEFAULT_HOST = "localhost"
PROMETHEUS_DEFAULT_PORT = 9464

SCRAPE_WORKERS = 8  # scrapes served at once (Prometheus replicas, a curl); more are closed
SCRAPE_TIMEOUT_S = 5.0  # for the whole request, and per write: a client that stalls is dropped


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

        registry = CollectorRegistry(auto_describe=True)
        super().__init__(registry=registry, **reader_options)
        # Not prometheus_client's start_http_server: it gives every connection a thread with no
        # timeout, so idle or slow clients pile up threads in the agent (or the job's process).
        handler = type(
            "ScrapeHandler", (MetricsHandler.factory(registry),), {"timeout": SCRAPE_TIMEOUT_S}
        )
        try:
            self._server = BoundedServer(
                (host, port), handler, SCRAPE_WORKERS, "otel-gpu-prometheus"
            )
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
