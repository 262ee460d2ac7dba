"""Scrape an inference server's Prometheus endpoint (``--server-metrics URL``) each interval.

The scrape runs on its own thread of the sidecar (never in an OTel callback): one GET bounded by
:data:`TIMEOUT_S` and :data:`MAX_BODY_BYTES`, parsed by :func:`engines.parse_exposition`. The
instruments read the last state only while it is fresh (younger than three intervals), so a
server that stopped answering shows gaps, not its last numbers forever.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.core import signals as sig
from otel_gpu.core.signals import Signal, observable
from otel_gpu.inference.engines import ServerState, parse_exposition

log = logging.getLogger("otel_gpu.inference")

TIMEOUT_S = 2.0  # per scrape: a hung server must not delay the next sweep's readiness verdict
MAX_BODY_BYTES = 8 * 1024 * 1024  # a vLLM exposition with histograms is ~100 KB
_FRESH_INTERVALS = 3.0
# No proxy: the server is in the pod, and a pod's HTTP_PROXY must not carry the scrape away.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# The normalized instruments: each signal and the ServerState field it reports.
_INSTRUMENTS: tuple[tuple[Signal, Callable[[ServerState], float | None]], ...] = (
    (sig.INFERENCE_KV_CACHE_UTILIZATION, lambda s: s.kv_cache_utilization),
    (sig.INFERENCE_REQUESTS_RUNNING, lambda s: s.requests_running),
    (sig.INFERENCE_REQUESTS_WAITING, lambda s: s.requests_waiting),
    (sig.INFERENCE_PREEMPTIONS, lambda s: s.preemptions),
    (sig.INFERENCE_QUEUE_TIME, lambda s: s.queue_seconds),
)


class ServerScraper:
    """Polls one URL; ``latest`` is the newest state, ``fresh()`` it while recent enough."""

    def __init__(
        self,
        url: str,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self._clock = clock
        self.latest: ServerState | None = None
        self.failures = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def fresh(self) -> ServerState | None:
        state = self.latest
        if state is None or self._clock() - state.time > _FRESH_INTERVALS * self.interval_s:
            return None
        return state

    def scrape_once(self) -> ServerState | None:
        """One GET and parse; the state, or None (the reason in ``last_error``, logged once)."""
        try:
            request = urllib.request.Request(self.url, headers={"Accept": "text/plain"})
            with _DIRECT.open(request, timeout=TIMEOUT_S) as response:
                body = response.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"response larger than {MAX_BODY_BYTES} bytes")
            state = parse_exposition(body.decode("utf-8", "replace"), self._clock())
            if state is None:
                raise ValueError("no vLLM, SGLang, TGI or Triton metrics in the response")
        except (OSError, ValueError, urllib.error.URLError) as exc:
            self.failures += 1
            self._note_error(f"{type(exc).__name__}: {exc}")
            return None
        if self.last_error is not None:
            log.info("server metrics at %s readable again (%s)", self.url, state.engine)
        self.last_error = None
        self.latest = state
        return state

    def _note_error(self, reason: str) -> None:
        if reason != self.last_error:
            log.warning("cannot read server metrics at %s: %s", self.url, reason)
        self.last_error = reason

    def start(self) -> ServerScraper:
        self._thread = threading.Thread(target=self._loop, name="otel-gpu-scrape", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.scrape_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the normalized instruments --------------------------------------------------------

    def register_instruments(self, meter: Meter) -> list[object]:
        """``otel_gpu.inference.*`` (``otel_gpu.core.signals.inference``; docs/kubernetes.md),
        with ``otel_gpu.inference.engine``."""
        return [observable(meter, signal, [self._callback(read)]) for signal, read in _INSTRUMENTS]

    def _callback(
        self, read: Callable[[ServerState], float | None]
    ) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(_options: CallbackOptions) -> list[Observation]:
            state = self.fresh()
            if state is None:
                return []
            value = read(state)
            if value is None:
                return []
            return [Observation(value, {sig.INFERENCE_ENGINE: state.engine})]

        return observe
