"""Export failures are reported once per episode: first failure, a periodic count, recovery."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from opentelemetry.metrics import Observation
from support.otlp_sink import OtlpSink

from otel_gpu.agent.export import meter_provider
from otel_gpu.agent.settings import Settings
from otel_gpu.core.export_log import ExportEpisodes, short_cause
from otel_gpu.core.shutdown import shutdown_provider


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# (time s, export ok?, expected line fragment or None for silence)
EPISODE = [
    (0, True, None),  # healthy: nothing to say
    (10, False, "metric export to X failed: UNAVAILABLE"),
    (20, False, None),
    (60, False, None),
    (70, False, "still failing after 60 s (4 failed exports)"),
    (80, False, None),
    (130, False, "still failing after 120 s (6 failed exports)"),
    (140, True, "recovered after 130 s (6 failed exports)"),
    (150, True, None),
    (160, False, "metric export to X failed"),  # a new episode starts with its cause again
]


@pytest.mark.unit
def test_one_line_per_episode_with_a_periodic_count() -> None:
    clock = Clock()
    episodes = ExportEpisodes("metric export to X", report_every_s=60, clock=clock)
    for t, ok, expected in EPISODE:
        clock.now = t
        line = episodes.result(ok, "UNAVAILABLE (Connection refused)")
        if expected is None:
            assert line is None, (t, line)
        else:
            assert line is not None and expected in line, (t, line)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("sdk_line", "cause"),
    [
        (
            "Failed to export metrics to 127.0.0.1:1, error code: StatusCode.UNAVAILABLE, error "
            "details: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
            "Failed to connect to remote host: Connection refused",
            "UNAVAILABLE (Connection refused)",
        ),
        ("Failed to export metrics, error code: StatusCode.UNIMPLEMENTED", "UNIMPLEMENTED"),
        ("something else entirely", "something else entirely"),
    ],
)
def test_the_cause_is_cut_from_the_sdks_long_lines(sdk_line: str, cause: str) -> None:
    assert short_cause(sdk_line) == cause


@pytest.mark.process
def test_a_real_outage_and_recovery_each_log_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """The SDK's OTLP exporter against a closed port, then a real OTLP server on that port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(
        endpoint=f"http://127.0.0.1:{port}", export_interval_s=0.3, export_timeout_s=0.5
    )
    caplog.set_level(logging.WARNING)
    provider = meter_provider(settings)
    closed = False
    provider.get_meter("t").create_observable_gauge("g", [lambda _o: [Observation(1.0)]])
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not _lines(caplog, "failed:"):
            time.sleep(0.1)
        time.sleep(1.0)  # more failed exports
        with OtlpSink(port) as sink:
            while time.monotonic() < deadline and not _lines(caplog, "recovered"):
                time.sleep(0.1)
            assert sink.metric_requests
            closed = shutdown_provider(provider, 2.0)  # while the collector is up
    finally:
        if not closed:
            shutdown_provider(provider, 2.0)
    assert len(_lines(caplog, "failed:")) == 1
    assert len(_lines(caplog, "recovered after")) == 1
    sdk = [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    assert [r for r in sdk if r.levelno >= logging.WARNING] == []


def _lines(caplog: pytest.LogCaptureFixture, fragment: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "otel_gpu.export" and fragment in r.getMessage()
    ]
