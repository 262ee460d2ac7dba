"""Export problems reported once per episode: the first failure, a count now and then, recovery.

With no collector, the SDK's OTLP exporter logs two ~300-character lines per export (a retry
warning and a final error), every export interval, for as long as the collector is down. The
otel-gpu commands instead wrap the exporter: the SDK's own lines are kept as the detail of the
current failure and not printed, and :class:`ExportEpisodes` decides what is said.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otel_gpu.core.redact import redact_text

log = logging.getLogger("otel_gpu.export")

# The SDK's loggers whose export warnings the episode report replaces.
SDK_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"
REPORT_EVERY_S = 60.0  # while an export keeps failing, how often the count is reported
_STATUS = re.compile(r"StatusCode\.([A-Z_]+)")


def count_points(data: MetricsData) -> int:
    """The data points in one export."""
    return sum(
        len(metric.data.data_points)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    )


class ExportEpisodes:
    """Turns a sequence of export results into at most one log line each (pure; clock injected).

    An episode starts at the first failure (reported with its cause), is summarized every
    ``report_every_s`` while it lasts (how long, how many exports failed), and ends with a
    recovery line at the next success.
    """

    def __init__(
        self,
        what: str,
        report_every_s: float = REPORT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.report_every_s = report_every_s
        self._clock = clock
        self._since: float | None = None  # start of the current failure episode
        self._reported_at = 0.0
        self._failures = 0

    def result(self, ok: bool, cause: str = "") -> str | None:
        """The line to log for one export's outcome, or None when nothing new is to be said."""
        now = self._clock()
        if ok:
            if self._since is None:
                return None
            line = (
                f"{self.what} recovered after {now - self._since:.0f} s "
                f"({self._failures} failed exports)"
            )
            self._since, self._failures = None, 0
            return line
        self._failures += 1
        if self._since is None:
            self._since = self._reported_at = now
            return (
                f"{self.what} failed: {cause or 'unknown error'}; retrying every export "
                f"(reported again every {self.report_every_s:.0f} s while it lasts, and on "
                "recovery)"
            )
        if now - self._reported_at >= self.report_every_s:
            self._reported_at = now
            return (
                f"{self.what} still failing after {now - self._since:.0f} s "
                f"({self._failures} failed exports): {cause or 'unknown error'}"
            )
        return None


def short_cause(message: str) -> str:
    """``UNAVAILABLE (Connection refused)`` from the SDK's long export error lines."""
    status = _STATUS.search(message)
    last = message.rstrip(". ").rpartition(": ")[2].strip()
    if status and last and status.group(1) not in last:
        return f"{status.group(1)} ({last[:120]})"
    if status:
        return status.group(1)
    return message[:160]


class _CauseKeeper(logging.Filter):
    """Keeps the SDK exporter's latest warning as the cause of the failure, and drops it."""

    def __init__(self) -> None:
        super().__init__()
        self.last = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.last = short_cause(record.getMessage())
        return False


_keeper: _CauseKeeper | None = None


def _cause_keeper() -> _CauseKeeper:
    """One filter per process on the SDK exporter's logger (installed on first use)."""
    global _keeper
    if _keeper is None:
        _keeper = _CauseKeeper()
        logging.getLogger(SDK_EXPORTER_LOGGER).addFilter(_keeper)
    return _keeper


class EpisodeReportingExporter(MetricExporter):
    """Wraps a metric exporter: same exports, failures reported once per episode."""

    def __init__(self, inner: MetricExporter, what: str, episodes: ExportEpisodes | None = None):
        # The reader asks the exporter for these; they are the wrapped exporter's choices.
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._episodes = episodes or ExportEpisodes(what)
        self._causes = _cause_keeper()
        self._delivered = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        self._causes.last = ""
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            cause = self._causes.last
        except Exception as exc:  # the reader would log a traceback per export
            result, cause = MetricExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        ok = result is MetricExportResult.SUCCESS
        line = self._episodes.result(ok, cause)
        if line:
            log.warning("%s", line)
        elif ok and not self._delivered:
            log.info(
                "%s: first export delivered (%d data points)",
                self._episodes.what,
                count_points(metrics_data),
            )
        self._delivered = self._delivered or ok
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class EpisodeReportingSignalExporter:
    """Wraps a span or log record exporter the same way: same exports, failures reported once
    per episode (the SDK's retry lines dropped). Everything else is the wrapped exporter's."""

    def __init__(self, inner: Any, what: str, episodes: ExportEpisodes | None = None) -> None:
        self._inner = inner
        self._episodes = episodes or ExportEpisodes(what)
        self._causes = _cause_keeper()

    def export(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self._causes.last = ""
        try:
            result = self._inner.export(batch, *args, **kwargs)
        except Exception as exc:
            self._report(False, f"{type(exc).__name__}: {exc}")
            raise
        self._report(getattr(result, "name", "") == "SUCCESS", self._causes.last)
        return result

    def _report(self, ok: bool, cause: str) -> None:
        line = self._episodes.result(ok, cause)
        if line:
            log.warning("%s", line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ObservedStub:
    """A gRPC metrics stub whose ``Export`` answers are also handed to ``on_reply``."""

    def __init__(self, stub: Any, on_reply: Callable[[Any], None]) -> None:
        self._stub = stub
        self._on_reply = on_reply

    def Export(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (the stub's naming)
        reply = self._stub.Export(*args, **kwargs)
        try:
            self._on_reply(reply)
        except Exception:  # reporting must never fail an export
            log.debug("reading the export answer failed", exc_info=True)
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


class PartialSuccessReport:
    """The collector's ``partial_success`` (points it accepted the request for but rejected),
    which the SDK's OTLP exporter discards: counted through ``on_rejected`` and logged on the
    first rejection and then at most every ``every_s`` with the running count. Never retried
    (the OTLP spec: a partial success must not be sent again)."""

    def __init__(
        self,
        what: str,
        on_rejected: Callable[[int], None] | None = None,
        *,
        every_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.rejected = 0
        self._on_rejected = on_rejected
        self._every_s = every_s
        self._clock = clock
        self._logged_at: float | None = None

    def attach(self, exporter: Any) -> bool:
        """Read every answer ``exporter`` (the SDK's OTLPMetricExporter) gets, including after
        it reconnects. Uses the exporter's private stub factory; False (and nothing changes)
        when this SDK version has none."""
        factory = getattr(exporter, "_stub", None)
        client = getattr(exporter, "_client", None)
        if factory is None or client is None or not hasattr(client, "Export"):
            log.debug("cannot read export answers from this OpenTelemetry SDK")
            return False
        exporter._stub = lambda channel: _ObservedStub(factory(channel), self.on_reply)
        exporter._client = _ObservedStub(client, self.on_reply)
        return True

    def on_reply(self, reply: Any) -> None:
        partial = getattr(reply, "partial_success", None)
        count = int(getattr(partial, "rejected_data_points", 0) or 0)
        if count <= 0:
            return
        self.rejected += count
        if self._on_rejected is not None:
            self._on_rejected(count)
        now = self._clock()
        if self._logged_at is None or now - self._logged_at >= self._every_s:
            self._logged_at = now
            reason = redact_text(str(getattr(partial, "error_message", "") or "no reason given"))
            log.warning(
                "%s: the collector rejected %d data point(s) (%s); %d rejected so far, not "
                "sent again",
                self.what,
                count,
                reason[:200],
                self.rejected,
            )
