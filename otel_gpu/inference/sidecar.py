"""The inference server's part of a sidecar session: ``/readyz``, the serving conditions that
feed it and the detectors' phase, and the server's own metrics (``--server-metrics``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from otel_gpu.agent.health import Check
from otel_gpu.agent.session import AgentInputs, SessionPart
from otel_gpu.core.signals import SCHEMA_URL
from otel_gpu.detect.breaker import BreakerConfig
from otel_gpu.inference.readiness import Readiness, ReadinessConfig
from otel_gpu.inference.serving import ServingConditions, ServingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_gpu.agent.agent import Agent
    from otel_gpu.inference.scrape import ServerScraper

log = logging.getLogger("otel_gpu.sidecar")


class ServingReadiness(SessionPart):
    """Readiness from serving-fatal conditions: the agent's leak alerts, lost GPUs and fatal
    Xids of each sweep, and (with ``server_metrics``) a serving stall seen in the server's
    queue, which also gives the detectors the ``load`` phase while the KV cache fills."""

    name = "scrape"

    def __init__(
        self, env: Mapping[str, str], server_metrics: str | None, interval_s: float
    ) -> None:
        """``env``: where the ``OTEL_GPU_READY_*`` and ``OTEL_GPU_BREAKER_*`` settings are
        read (UsageError on a bad one). ``server_metrics``: the server's Prometheus URL."""
        # Readiness opens on the first serving-fatal alert, whatever the notify threshold is.
        self.readiness = Readiness(
            ReadinessConfig.from_env(env), BreakerConfig.from_env(env, alerts_to_open=1)
        )
        self.serving = ServingConditions(ServingConfig.from_env(env))
        self.scraper: ServerScraper | None = None
        if server_metrics:
            from otel_gpu.inference.scrape import ServerScraper

            self.scraper = ServerScraper(server_metrics, interval_s)
        self._dispatch: Callable[[Any], None] = lambda _t: None

    def routes(self) -> Mapping[str, Check]:
        return {"/readyz": self.readiness.verdict}

    def configure(self, inputs: AgentInputs) -> None:
        inputs.phase = self.serving.phase

    def attach(self, agent: Agent, provider: MeterProvider) -> None:
        if self.scraper is not None:
            self.scraper.register_instruments(provider.get_meter("otel_gpu", schema_url=SCHEMA_URL))
        if agent.watchdog is not None:
            agent.watchdog.alert_listeners.append(self.readiness.on_alert)
            if agent.watchdog.dispatcher is not None:
                self._dispatch = agent.watchdog.dispatcher.on_transition
        # Added after the watchdog's listener: this sweep's leak alerts have reached readiness.
        agent.sampler.add_listener(self.on_snapshot)

    def on_snapshot(self, snap: Any) -> None:
        """After each sweep, on the sampler thread."""
        utils = [g.util_gpu for g in snap.gpus if g.status == "ok"]
        fresh = self.scraper.fresh() if self.scraper is not None else None
        started, active = self.serving.observe(snap.time, utils, fresh)
        for alert in started:
            log.warning("%s", alert.message)
        for t in self.readiness.observe(snap, active):
            log.warning("readiness: %s", t.reason)
            if t.subject == "server":  # GPU subjects notify through the agent's own breaker
                self._dispatch(t)

    def start(self) -> None:
        if self.scraper is not None:
            self.scraper.start()

    def stop(self, timeout_s: float) -> None:
        if self.scraper is not None:
            self.scraper.stop(timeout_s)
