"""Subject quotas keyed on what a client cannot choose, and "agent-watched" bound to the
reporter that owns a subject (issue 18, items 7 and 8).

The peer is the client's address, which the gRPC handler takes from the connection
(``tests/test_processor_calls.py`` shows it from real sockets); here the pipeline is driven
with two peers directly. Before the fix one client claiming ten reporter identities filled the
whole subject cap (a real node's GPUs were then never judged, its exports got OK with no
``partial_success``, nothing was logged, ``/healthz`` said ok), and anyone who could send OTLP
could silence detection for a subject by sending ``otel_gpu.breaker.state`` points carrying
its identity."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from support.half_open import RawCall
from support.otlp_receiver import call
from support.processor import in_process_config, leak_requests
from support.synth import agent_request, gpu_uuid

from otel_gpu.core import signals as sig
from otel_gpu.detect.breaker import Breaker, BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.subject import SUBJECT_KIND
from otel_gpu.processor import Processor
from otel_gpu.processor.pipeline import Detection
from otel_gpu.processor.store import StateStore
from otel_gpu.processor.wire import METRICS_EXPORT

ATTACKER, VICTIM = "10.0.0.66", "10.0.0.7"
T0 = time.time() - 6 * 3600


def detection(tmp_path: Path, **caps: int) -> Detection:
    return Detection(
        in_process_config(**caps),
        Engine(),
        Breaker(BreakerConfig(cooldown_s=1e6)),
        StateStore(str(tmp_path / "state.db")),
        None,
        lambda _method, _body: None,
    )


def claimed(identity: int, gpus: int, k: int = 0) -> bytes:
    """A collection of ``gpus`` GPUs under a made-up reporter identity."""
    req = agent_request(
        int((T0 + 15 * k) * 1e9), gpus=gpus, processes=0, instance=f"fake-{identity}"
    )
    return req.SerializeToString()  # type: ignore[no-any-return]


def _kv(key: str, value: str | int) -> KeyValue:
    v = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def breaker_points(k: int) -> bytes:
    """``otel_gpu.breaker.state`` (closed) for the GPU and the process of ``leak_requests``,
    under the same resource identity: what the reporter's own agent would send."""
    req = agent_request(int((T0 + 15 * k) * 1e9), gpus=1, processes=1, instance="run-1")
    sm = req.resource_metrics[0].scope_metrics[0]
    del sm.metrics[:]
    metric = sm.metrics.add(name=sig.BREAKER_STATE.name)
    for attrs in (
        [(SUBJECT_KIND, "gpu"), (sig.HW_ID, gpu_uuid(0))],
        [(SUBJECT_KIND, "process_gpu"), (sig.HW_ID, gpu_uuid(0)), (sig.PROCESS_PID, 10_000)],
    ):
        dp = metric.gauge.data_points.add(time_unix_nano=int((T0 + 15 * k) * 1e9), as_int=0)
        dp.attributes.extend(_kv(key, value) for key, value in attrs)
    return req.SerializeToString()  # type: ignore[no-any-return]


@pytest.mark.unit
def test_one_client_claiming_ten_identities_cannot_starve_another_clients_gpus(
    tmp_path: Path,
) -> None:
    det = detection(tmp_path, max_series=200, max_series_per_reporter=20, max_series_per_peer=100)
    for identity in range(10):  # 10 x 20 GPUs: the whole cap, were identities the quota key
        det.ingest_metrics(claimed(identity, 20), ATTACKER)
    stats = det.stats()
    assert stats.subjects == 100 and stats.peer_refused > 0 and stats.cap_refused == 0
    for raw in leak_requests(600):  # the real node: one GPU whose process leaks
        det.ingest_metrics(raw, VICTIM)
    det.tick(final=True)
    stats = det.stats()
    assert stats.alerts >= 1 and stats.cap_refused == 0  # its GPU was judged: the leak found


@pytest.mark.unit
def test_the_quota_log_line_is_once_per_peer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    det = detection(tmp_path, max_series=200, max_series_per_reporter=20, max_series_per_peer=30)
    with caplog.at_level(logging.WARNING, logger="otel_gpu.processor"):
        for identity in range(6):
            det.ingest_metrics(claimed(identity, 20), ATTACKER)
    lines = [r.getMessage() for r in caplog.records if "--max-series-per-peer" in r.getMessage()]
    assert len(lines) == 1 and ATTACKER in lines[0] and "quota of 30" in lines[0]


@pytest.mark.unit
def test_a_full_global_cap_is_logged_once_degrades_health_and_answers_partial_success(
    caplog: pytest.LogCaptureFixture,
) -> None:
    proc = Processor(
        in_process_config(max_series=30, max_series_per_reporter=20, max_series_per_peer=30)
    )
    try:
        assert proc.health()[0]
        replies = []
        with caplog.at_level(logging.WARNING, logger="otel_gpu.processor"):
            for identity in range(4):  # 20 + 10 held; then the cap refuses
                replies.append(proc.export_metrics(METRICS_EXPORT, claimed(identity, 20), VICTIM))
        assert replies[0] == b""  # all judged: a plain OK
        partial = ExportMetricsServiceResponse.FromString(replies[1]).partial_success
        assert partial.rejected_data_points > 0 and "not judged" in partial.error_message
        assert "--max-series" in partial.error_message
        last = ExportMetricsServiceResponse.FromString(replies[3]).partial_success
        assert (
            last.rejected_data_points
            == ExportMetricsServiceResponse.FromString(
                replies[2]
            ).partial_success.rejected_data_points
        )  # every point of a refused reporter
        lines = [r.getMessage() for r in caplog.records if "subject cap is full" in r.getMessage()]
        assert len(lines) == 1
        ok, text = proc.health()
        assert not ok and text.startswith("degraded: the subject cap is full (--max-series 30)")
        assert proc.stats()["detection"]["cap_refused"] > 0
    finally:
        proc.stop(1)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("voucher", "judged"),
    [(ATTACKER, True), (VICTIM, False)],
    ids=["another-client-spoofs", "its-own-agent-vouches"],
)
def test_breaker_points_silence_a_subject_only_from_the_peer_that_owns_it(
    tmp_path: Path, voucher: str, judged: bool
) -> None:
    det = detection(tmp_path)
    for k, raw in enumerate(leak_requests(600)):
        if k % 20 == 0:
            det.ingest_metrics(breaker_points(k), voucher)  # "an agent judges these"
        det.ingest_metrics(raw, VICTIM)
    det.tick(final=True)
    stats = det.stats()
    if judged:  # the spoof is ignored: the leak is found and alerted
        assert stats.alerts >= 1 and stats.vouch_refused > 0
    else:  # the reporter's own word: left to its agent, as before
        assert stats.alerts == 0 and stats.agent_watched == 2 and stats.vouch_refused == 0


@pytest.mark.process
def test_over_real_connections_the_quota_follows_the_clients_address() -> None:
    """The same attack over real sockets: the attacker's calls from 127.0.0.2 (raw HTTP/2),
    the real node's from 127.0.0.1 (a gRPC client); the processor tells them apart by the
    address of each connection."""
    proc = Processor(
        in_process_config(
            max_series=200,
            max_series_per_reporter=20,
            max_series_per_peer=100,
        )
    )
    proc.start()
    attacker = RawCall(int(proc.address.rsplit(":", 1)[1]))
    try:
        replies = [attacker.call(METRICS_EXPORT, claimed(identity, 20)) for identity in range(10)]
        det = proc.stats()["detection"]
        assert det["subjects"] == 100 and det["peer_refused"] > 0
        refused = ExportMetricsServiceResponse.FromString(replies[-1]).partial_success
        assert refused.rejected_data_points > 0 and "--max-series-per-peer" in refused.error_message
        channel = grpc.insecure_channel(proc.address)
        for raw in leak_requests(600):
            reply, _ = call(proc.address, METRICS_EXPORT, raw, channel=channel)
            assert reply == b""  # every point of the real node judged: no partial_success
        channel.close()
        proc.detection.tick(final=True)
        assert proc.stats()["detection"]["alerts"] >= 1
    finally:
        attacker.close()
        proc.stop(2)


@pytest.mark.process
def test_over_real_connections_another_clients_breaker_points_do_not_silence_a_leak() -> None:
    proc = Processor(in_process_config())
    proc.start()
    attacker = RawCall(int(proc.address.rsplit(":", 1)[1]))
    try:
        channel = grpc.insecure_channel(proc.address)
        for k, raw in enumerate(leak_requests(600)):
            if k % 20 == 0:
                attacker.call(METRICS_EXPORT, breaker_points(k))
            call(proc.address, METRICS_EXPORT, raw, channel=channel)
        channel.close()
        proc.detection.tick(final=True)
        det = proc.stats()["detection"]
        assert det["alerts"] >= 1 and det["vouch_refused"] > 0 and det["agent_watched"] <= 2
    finally:
        attacker.close()
        proc.stop(2)
