"""docs/reliability.md section D, the export path: the agent's own exporter wiring
(:func:`otel_gpu.agent.export.metric_readers`, the SDK's OTLP gRPC exporter, :class:`CountingExporter`)
against small real servers on 127.0.0.1 that misbehave the ways collectors do.

Each export must end within the configured timeout, whatever the peer does; what it lost is
counted (``otel_gpu.agent.export.failures`` / ``dropped_points``); answers that say "later" are
waited out as the server asks; answers that say "never" are not retried; and sampling goes on
while an export hangs.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from support.collectors import Partial, Refusal, ScriptedCollector, serving

from otel_gpu.agent import instruments as metrics
from otel_gpu.agent import selfmetrics
from otel_gpu.agent.export import metric_readers
from otel_gpu.agent.selfmetrics import ExportHealth
from otel_gpu.agent.settings import Settings
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.sim import SimulatedSource

pytestmark = pytest.mark.process

OK = None  # an answer: success


@contextmanager
def raw_listener(on_connection=None) -> Iterator[str]:
    """A TCP listener that speaks no gRPC: with ``on_connection`` each accepted socket is
    handed to it, without, connections are accepted by the kernel and never read (a
    blackhole). Yields its ``http://`` endpoint."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def accept_loop() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            on_connection(conn)

    thread = None
    if on_connection is not None:
        thread = threading.Thread(target=accept_loop, daemon=True)
        thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        if thread is not None:
            thread.join(2)
        listener.close()


def reset_after_reading(conn: socket.socket) -> None:
    """Read what the client sends first, then reset the connection (RST, not FIN)."""
    conn.settimeout(2)
    with suppress(OSError):
        conn.recv(65536)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class Exporting:
    """The agent's metric pipeline (simulated GPU, the real instruments and self-metrics,
    the readers :func:`metric_readers` builds) with a manual export: :meth:`export_once`."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.health = ExportHealth()
        settings = Settings(endpoint=endpoint, export_timeout_s=timeout_s, export_interval_s=3600)
        (self.reader,) = metric_readers(settings, export_health=self.health)
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.sampler = Sampler(SimulatedSource("steady"), None, interval_s=0.1)
        meter = self.provider.get_meter("t")
        metrics.register(meter, self.sampler.fresh)
        selfmetrics.register(meter, self.sampler, self.health)
        self.sampler.sample_once()

    def export_once(self) -> float:
        """Collect and export once; the seconds it took."""
        began = time.monotonic()
        self.reader.collect(timeout_millis=60_000)
        return time.monotonic() - began

    def close(self) -> None:
        self.provider.shutdown(timeout_millis=500)


@pytest.fixture
def exporting():
    made: list[Exporting] = []

    def make(endpoint: str, timeout_s: float) -> Exporting:
        made.append(Exporting(endpoint, timeout_s))
        return made[-1]

    yield make
    for e in made:
        e.close()


# (answers, attempts the collector sees, export succeeds, least gap between attempts in s)
ANSWERS = {
    # The server asks to wait 1.6 s: longer than the SDK's own first backoff (0.8-1.2 s), so a
    # gap of at least 1.5 s shows the exporter waited as told.
    "resource exhausted with RetryInfo": (
        [Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, 1.6), OK],
        2,
        True,
        1.5,
    ),
    "unavailable with RetryInfo": ([Refusal(grpc.StatusCode.UNAVAILABLE, 1.6), OK], 2, True, 1.5),
    "unavailable": ([Refusal(grpc.StatusCode.UNAVAILABLE), OK], 2, True, 0.5),
    # A wait longer than what is left of the export timeout: drop now rather than overrun.
    "retry later than the timeout": (
        [Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, 30.0), OK],
        1,
        False,
        0,
    ),
    # Permanent refusals (HTTP 400 / 401 / 403 in gRPC terms): never retried, dropped.
    "invalid argument": ([Refusal(grpc.StatusCode.INVALID_ARGUMENT), OK], 1, False, 0),
    "unauthenticated": ([Refusal(grpc.StatusCode.UNAUTHENTICATED), OK], 1, False, 0),
    "permission denied": ([Refusal(grpc.StatusCode.PERMISSION_DENIED), OK], 1, False, 0),
}


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_collector_answers_are_retried_or_dropped_as_they_ask(exporting, case: str) -> None:
    answers, attempts, succeeds, least_gap = ANSWERS[case]
    collector = ScriptedCollector(answers)
    with serving(collector) as endpoint:
        pipeline = exporting(endpoint, timeout_s=6.0)
        took = pipeline.export_once()
    assert len(collector.arrivals) == attempts, collector.arrivals
    if attempts == 2:
        assert collector.arrivals[1] - collector.arrivals[0] >= least_gap
    health = pipeline.health
    assert (health.exports, health.failures) == (1, 0 if succeeds else 1)
    if succeeds:
        assert health.dropped_points == 0 and health.failing_since is None
    else:  # dropped at once, and every point of the batch counted as lost
        points = sum(len(m.data_points) for m in _metrics(collector.requests[0]))
        assert health.dropped_points == points > 10
        assert took < 6.0


def _metrics(request) -> list:
    out = []
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.append(getattr(m, m.WhichOneof("data")))
    return out


PEERS = ("refused", "blackhole", "slow", "reset mid-request", "TLS against a plain server")


@contextmanager
def peer(kind: str) -> Iterator[str]:
    if kind == "refused":
        with socket.socket() as s:  # bound, never listening: connections are refused
            s.bind(("127.0.0.1", 0))
            yield f"http://127.0.0.1:{s.getsockname()[1]}"
    elif kind == "blackhole":
        with raw_listener() as endpoint:
            yield endpoint
    elif kind == "slow":  # answers, but after the client's deadline
        with serving(ScriptedCollector([OK], delay_s=4.0)) as endpoint:
            yield endpoint
    elif kind == "reset mid-request":
        with raw_listener(reset_after_reading) as endpoint:
            yield endpoint
    else:  # the exporter insists on TLS; the server speaks plain HTTP/2
        with serving(ScriptedCollector([OK])) as endpoint:
            yield endpoint.replace("http://", "https://")


@pytest.mark.parametrize("kind", PEERS)
def test_an_export_to_a_broken_collector_ends_within_its_timeout_and_is_counted(
    exporting, kind: str
) -> None:
    with peer(kind) as endpoint:
        pipeline = exporting(endpoint, timeout_s=1.0)
        took = pipeline.export_once()
    # The SDK retries UNAVAILABLE with backoff, but only within the one-second budget; the
    # bound is generous for a loaded machine and far below the SDK's own 10 s default.
    assert took < 4.0, took
    health = pipeline.health
    assert (health.exports, health.failures) == (1, 1)
    assert health.dropped_points > 10 and health.failing_since is not None


def test_sampling_goes_on_while_an_export_hangs(exporting) -> None:
    """The collection loop (the sampler thread) never waits for the exporter."""
    with raw_listener() as endpoint:
        pipeline = exporting(endpoint, timeout_s=2.0)
        sampler = pipeline.sampler
        sweeps: list[float] = []
        sampler.add_listener(lambda snap: sweeps.append(time.monotonic()))
        sampler.start()
        try:
            began = time.monotonic()
            took = pipeline.export_once()  # blocks this thread for the whole timeout
            during = [t for t in sweeps if began <= t <= began + took]
        finally:
            sampler.stop()
    assert took >= 1.5  # it really hung on the blackhole...
    assert len(during) >= 3, during  # ...while sweeps (one per 0.1 s) kept coming
    assert pipeline.health.failures == 1


def test_a_batch_sent_again_after_a_lost_answer_is_the_same_batch(exporting) -> None:
    """Duplicate tolerance: a collector that took the batch but whose answer was lost
    (UNAVAILABLE after reading it, as a proxy whose upstream got it) makes the SDK send it
    again. The copy carries the same timestamps and cumulative values, so a backend sees one
    point per series and time, not a doubled counter."""
    collector = ScriptedCollector([Refusal(grpc.StatusCode.UNAVAILABLE, 0.1), OK])
    with serving(collector) as endpoint:
        pipeline = exporting(endpoint, timeout_s=6.0)
        pipeline.export_once()
    assert len(collector.requests) == 2 and pipeline.health.failures == 0
    first, again = (
        sorted(
            (m.name, p.time_unix_nano, p.start_time_unix_nano, p.as_int, p.as_double)
            for rm in r.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            for p in getattr(m, m.WhichOneof("data")).data_points
        )
        for r in collector.requests
    )
    assert first == again and len(first) > 10


def test_a_partial_success_is_counted_logged_once_and_not_sent_again(
    exporting, caplog: pytest.LogCaptureFixture
) -> None:
    collector = ScriptedCollector([Partial(3, "bad points: hf_abcdefghijklmnopqrstuvwxyz0123")])
    with serving(collector) as endpoint:
        e = exporting(endpoint, 5.0)
        with caplog.at_level("WARNING", logger="otel_gpu.export"):
            e.export_once()
            e.export_once()
    assert len(collector.arrivals) == 2  # one attempt per export: a partial success is final
    assert e.health.rejected_points == 6 and e.health.failures == 0
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1 and "rejected 3 data point(s)" in lines[0]
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in lines[0]  # the collector's text, redacted
    (spec,) = [i for i in selfmetrics.INSTRUMENTS if i.name.endswith("export.rejected_points")]
    assert [o.value for o in spec.read(e.sampler, e.health)] == [6]


def test_partial_successes_are_still_read_after_the_exporter_reconnects(exporting) -> None:
    # UNAVAILABLE makes the SDK exporter build a new channel and stub: the answer to the retry
    # arrives through the stub factory, which must be watched too.
    collector = ScriptedCollector([Refusal(grpc.StatusCode.UNAVAILABLE), Partial(3, "bad")])
    with serving(collector) as endpoint:
        e = exporting(endpoint, 10.0)
        e.export_once()
    assert len(collector.arrivals) == 2
    assert e.health.rejected_points == 3 and e.health.failures == 0
