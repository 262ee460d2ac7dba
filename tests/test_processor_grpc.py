"""The processor over real gRPC: the official OTel SDK exporters in front, a receiver behind."""

from __future__ import annotations

import datetime
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support.otlp_receiver import Receiver, call, receiver
from support.processor import in_process_config, leak_requests
from support.synth import agent_request

from otel_gpu.detect.breaker import BreakerConfig
from otel_gpu.processor import Downstream, Processor
from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT, TRACE_EXPORT

pytestmark = pytest.mark.process

HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def start(downstream: Receiver | None = None, **overrides) -> Processor:
    cfg = in_process_config(
        forward=(Downstream(downstream.address),) if downstream else (),
        export_interval_s=overrides.pop("export_interval_s", 0.2),
        assemble_grace_s=overrides.pop("assemble_grace_s", 0.1),
        **overrides,
    )
    p = Processor(cfg, breaker_config=BreakerConfig(cooldown_s=1e6))
    p.start()
    return p


@pytest.fixture
def down() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


def test_sdk_metrics_traces_logs_are_forwarded_intact(down):
    proc = start(down)
    resource = Resource.create({"service.name": "fwd-test", "host.name": "h1"})
    endpoint = proc.address
    try:
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint, insecure=True, timeout=5),
            export_interval_millis=3_600_000,
        )
        mp = MeterProvider(resource=resource, metric_readers=[reader])
        meter = mp.get_meter("t")
        meter.create_counter("jobs.done").add(3, {"queue": "a"})
        meter.create_gauge("hw.power", unit="W").set(250.5, {"hw.id": "GPU-x"})
        assert mp.force_flush(10_000)
        tp = TracerProvider(resource=resource)
        tp.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True))
        )
        with tp.get_tracer("t").start_as_current_span("train") as span:
            span.set_attribute("step", 7)
        lp = LoggerProvider(resource=resource)
        lp.add_log_record_processor(
            SimpleLogRecordProcessor(OTLPLogExporter(endpoint=endpoint, insecure=True))
        )
        lp.get_logger("t").emit(
            LogRecord(body="hello downstream", severity_number=SeverityNumber.WARN)
        )
        assert down.wait_for(
            lambda: all(down.raw[m] for m in (METRICS_EXPORT, TRACE_EXPORT, LOGS_EXPORT))
        )
        (m,) = down.decoded(METRICS_EXPORT)
        res_attrs = {
            kv.key: kv.value.string_value for kv in m.resource_metrics[0].resource.attributes
        }
        assert res_attrs["service.name"] == "fwd-test"
        got = {x.name: x for x in m.resource_metrics[0].scope_metrics[0].metrics}
        assert got["jobs.done"].sum.data_points[0].as_int == 3
        assert got["hw.power"].gauge.data_points[0].as_double == 250.5
        (t,) = down.decoded(TRACE_EXPORT)
        span_pb = t.resource_spans[0].scope_spans[0].spans[0]
        assert span_pb.name == "train" and span_pb.attributes[0].value.int_value == 7
        (lg,) = down.decoded(LOGS_EXPORT)
        assert (
            lg.resource_logs[0].scope_logs[0].log_records[0].body.string_value == "hello downstream"
        )
        mp.shutdown()
        tp.shutdown()
        lp.shutdown()
    finally:
        proc.stop(2)


def test_request_bytes_are_forwarded_byte_for_byte(down):
    proc = start(down)
    try:
        raw = agent_request(int((time.time() - 60) * 1e9), gpus=2, processes=4).SerializeToString()
        resp, _ = call(proc.address, METRICS_EXPORT, raw)
        assert resp == b""
        assert down.wait_for(lambda: bool(down.raw[METRICS_EXPORT]))
        assert down.raw[METRICS_EXPORT][0] == raw
        # gzip on the wire (the SDK's only compression) changes nothing once received
        raw2 = agent_request(int((time.time() - 45) * 1e9), gpus=1, processes=1).SerializeToString()
        call(proc.address, METRICS_EXPORT, raw2, compression=grpc.Compression.Gzip)
        assert down.wait_for(lambda: len(down.raw[METRICS_EXPORT]) == 2)
        assert down.raw[METRICS_EXPORT][1] == raw2
    finally:
        proc.stop(2)


def test_leak_becomes_alert_log_records_and_detector_metrics_downstream(down):
    proc = start(down)
    try:
        for raw in leak_requests(600):
            call(proc.address, METRICS_EXPORT, raw)
        assert down.wait_for(lambda: len(down.alerts()) >= 2, timeout=10)
        # the GPU's memory and the process's memory both grow: one alert each
        kinds = {
            kv.value.string_value
            for a in down.alerts()
            for kv in a.attributes
            if kv.key == "otel_gpu.subject"
        }
        # the subjects' short names, the same the agent gives them (detect/subject.py)
        assert any(k.startswith("process:10000@GPU-") for k in kinds) and len(kinds) == 2
        alert = next(
            a for a in down.alerts() if any(kv.key == "process.pid" for kv in a.attributes)
        )
        attrs = {kv.key: kv.value for kv in alert.attributes}
        assert attrs["otel_gpu.alert.kind"].string_value == "leak"
        assert attrs["otel_gpu.leak.rate"].double_value == pytest.approx(1.33e6, rel=0.05)
        assert attrs["process.pid"].int_value == 10_000
        assert "leak" in alert.body.string_value
        assert down.wait_for(lambda: bool(down.metric_points("otel_gpu.breaker.state")))
        states = down.metric_points("otel_gpu.breaker.state")
        assert max(p.as_int for p in states) == 2  # open
        assert down.metric_points("otel_gpu.leak.rate")[0].as_double > 1e6
        assert down.metric_points("otel_gpu.memory.time_to_exhaustion")[0].as_double > 0
        assert down.metric_points("otel_gpu.alerts")[0].as_int >= 1
        transitions = [
            r for r in down.log_records() if r.event_name == "otel_gpu.breaker.transition"
        ]
        assert transitions and "opened" in transitions[0].body.string_value
    finally:
        proc.stop(2)


def test_hostile_inputs_get_clear_codes_and_never_kill_the_service(down):
    proc = start(down)
    try:
        for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05abc", bytes(range(256)) * 4):
            for method in (METRICS_EXPORT, TRACE_EXPORT, LOGS_EXPORT):
                with pytest.raises(grpc.RpcError) as e:
                    call(proc.address, method, garbage)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # empty requests are valid and forward nothing
        for method in (METRICS_EXPORT, TRACE_EXPORT, LOGS_EXPORT):
            assert call(proc.address, method, b"")[0] == b""
        # NaN / inf / absurd timestamps in detector series: partial success, cut from the copy
        req = agent_request(int((time.time() - 60) * 1e9), gpus=1, processes=1)
        metrics = req.resource_metrics[0].scope_metrics[0].metrics
        next(m for m in metrics if m.name == "hw.power").gauge.data_points[0].as_double = math.nan
        usage = next(m for m in metrics if m.name == "hw.gpu.memory.usage")
        usage.sum.data_points[0].time_unix_nano = 1
        resp, _ = call(proc.address, METRICS_EXPORT, req.SerializeToString())
        ps = ExportMetricsServiceResponse.FromString(resp).partial_success
        assert ps.rejected_data_points == 2 and ps.error_message
        assert down.wait_for(lambda: bool(down.raw[METRICS_EXPORT]))
        fwd = down.decoded(METRICS_EXPORT)[0]
        names = [m.name for m in fwd.resource_metrics[0].scope_metrics[0].metrics]
        by = {m.name: m for m in fwd.resource_metrics[0].scope_metrics[0].metrics}
        assert not by["hw.power"].gauge.data_points and "hw.temperature" in names
        # too large for the receive limit: refused by gRPC, service still up
        small = start(None, max_recv_bytes=64 * 1024)
        try:
            with pytest.raises(grpc.RpcError) as e:
                call(small.address, METRICS_EXPORT, b"\x0a" + b"\x80\x80\x10" + b"x" * 300_000)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            small.stop(1)
        ok = agent_request(int((time.time() - 30) * 1e9), gpus=1, processes=1).SerializeToString()
        assert call(proc.address, METRICS_EXPORT, ok)[0] == b""
        assert proc.stats()["invalid_argument"] == 9
    finally:
        proc.stop(2)


def test_overload_push_back_carries_retry_info_and_the_sdk_exporter_waits(down):
    proc = start(down, max_requests_per_s=1.0, retry_after_s=1.0)
    try:
        raw = agent_request(int((time.time() - 60) * 1e9), gpus=1, processes=1).SerializeToString()
        call(proc.address, METRICS_EXPORT, raw)  # takes the only token
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, raw)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(e.value.trailing_metadata())
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.seconds >= 1
        # The SDK exporter is refused, waits the RetryInfo delay, retries and succeeds.
        time.sleep(1.1)
        exporter = OTLPMetricExporter(endpoint=proc.address, insecure=True, timeout=10)
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
        mp = MeterProvider(metric_readers=[reader])
        mp.get_meter("t").create_counter("c").add(1)
        call(proc.address, METRICS_EXPORT, raw)  # empty the bucket again
        before = proc.stats().get("resource_exhausted", 0)
        t0 = time.monotonic()
        assert mp.force_flush(15_000)
        waited = time.monotonic() - t0
        assert proc.stats()["resource_exhausted"] == before + 1
        assert waited >= 0.8  # it honoured the delay instead of retrying at once
        assert down.wait_for(lambda: down.resources() == 3)
        mp.shutdown()
    finally:
        proc.stop(2)


def test_slow_downstream_never_blocks_ingestion():
    with receiver(delay_s=1.0) as slow:
        proc = start(slow, queue_requests=2)
        try:
            raw = agent_request(
                int((time.time() - 60) * 1e9), gpus=1, processes=1
            ).SerializeToString()
            t0 = time.monotonic()
            for _ in range(20):
                call(proc.address, METRICS_EXPORT, raw)
            assert time.monotonic() - t0 < 3.0
            fwd = proc.stats()["forward"][slow.address]
            assert fwd["dropped"] >= 10 and fwd["sent"] + fwd["dropped"] + fwd["queued"] <= 20
        finally:
            proc.stop(1)


def test_bearer_token_is_required_and_never_logged(down, caplog):
    token = "tok-5f2c9a1e"
    proc = start(down, token=token)
    raw = agent_request(int((time.time() - 60) * 1e9), gpus=1, processes=1).SerializeToString()
    try:
        with caplog.at_level(logging.DEBUG):
            for md in (None, (("authorization", "Bearer wrong"),), (("authorization", token),)):
                with pytest.raises(grpc.RpcError) as e:
                    call(proc.address, METRICS_EXPORT, raw, metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = call(
                proc.address, METRICS_EXPORT, raw, metadata=(("authorization", f"Bearer {token}"),)
            )
            assert ok[0] == b""
            exporter = OTLPMetricExporter(
                endpoint=proc.address, insecure=True, headers={"authorization": f"Bearer {token}"}
            )
            mp = MeterProvider(
                metric_readers=[
                    PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
                ]
            )
            mp.get_meter("t").create_counter("c").add(1)
            assert mp.force_flush(10_000)
            mp.shutdown()
        assert down.wait_for(lambda: down.resources() >= 2)
        assert token not in caplog.text
        assert proc.stats()["unauthenticated"] == 3
    finally:
        proc.stop(2)


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), cert_pem


def test_tls_serves_trusted_clients_only(down, tmp_path):
    cert, key, cert_pem = _self_signed(tmp_path)
    proc = start(down, tls_cert=cert, tls_key=key)
    raw = agent_request(int((time.time() - 60) * 1e9), gpus=1, processes=1).SerializeToString()
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert_pem)
        with grpc.secure_channel(proc.address, creds) as ch:
            assert call(proc.address, METRICS_EXPORT, raw, channel=ch)[0] == b""
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, raw, timeout=2)  # plaintext client
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        exporter = OTLPMetricExporter(endpoint=f"https://{proc.address}", credentials=creds)
        mp = MeterProvider(
            metric_readers=[
                PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
            ]
        )
        mp.get_meter("t").create_counter("c").add(1)
        assert mp.force_flush(10_000)
        mp.shutdown()
        assert down.wait_for(lambda: down.resources() >= 2)
    finally:
        proc.stop(2)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_endpoint_fails_when_ingestion_stalls(down):
    proc = start(down, health="127.0.0.1:0", stall_after_s=0.6)
    url = f"http://{proc.health_address}/healthz"
    raw = agent_request(int((time.time() - 60) * 1e9), gpus=1, processes=1).SerializeToString()
    try:
        assert _get(url) == (200, "ok: waiting for data\n")
        call(proc.address, METRICS_EXPORT, raw)
        code, text = _get(url)
        assert code == 200 and text.startswith("ok: last export request")
        assert call(proc.address, HEALTH_CHECK, b"")[0] == b"\x08\x01"  # SERVING
        time.sleep(0.9)
        code, text = _get(url)
        assert code == 503 and text.startswith("stalled:")
        assert call(proc.address, HEALTH_CHECK, b"")[0] == b"\x08\x02"  # NOT_SERVING
        # The probes' paths: a stall the agents cause neither restarts nor unreadies it.
        code, text = _get(f"http://{proc.health_address}/livez")
        assert code == 200 and text.startswith("live; health: stalled:")
        assert _get(f"http://{proc.health_address}/readyz") == (200, "ready\n")
        call(proc.address, METRICS_EXPORT, raw)
        assert _get(url)[0] == 200
        code, body = _get(f"http://{proc.health_address}/stats")
        assert code == 200 and '"metrics_requests": 2' in body
    finally:
        proc.stop(2)


def test_shutdown_flushes_pending_points_and_queued_forwards(down):
    proc = start(down, assemble_grace_s=60.0)
    try:
        raws = list(leak_requests(2))
        for raw in raws:
            call(proc.address, METRICS_EXPORT, raw)
        assert proc.stats()["detection"]["evaluated"] == 3  # the second timestamp is pending
    finally:
        t0 = time.monotonic()
        proc.stop(3)
    assert time.monotonic() - t0 < 4
    assert proc.stats()["detection"]["evaluated"] == 6
    # forwarded as sent (possibly merged into one call: the encodings concatenate)
    assert b"".join(down.raw[METRICS_EXPORT]).startswith(b"".join(raws))
    merged = ExportMetricsServiceRequest.FromString(b"".join(down.raw[METRICS_EXPORT]))
    assert len(merged.resource_metrics) >= 2


def test_too_many_requests_in_flight_are_pushed_back_with_retry_info(down):
    from concurrent import futures

    proc = start(down, max_inflight=1, retry_after_s=0.5)
    big = agent_request(int((time.time() - 60) * 1e9), gpus=16, processes=2048).SerializeToString()
    channel = grpc.insecure_channel(proc.address)
    try:

        def one(_: int) -> str:
            try:
                call(proc.address, METRICS_EXPORT, big, timeout=30, channel=channel)
                return "ok"
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "google.rpc.retryinfo-bin" in dict(e.trailing_metadata())
                return "pushed back"

        with futures.ThreadPoolExecutor(8) as ex:
            outcomes = list(ex.map(one, range(16)))
        assert "ok" in outcomes and "pushed back" in outcomes
        assert proc.stats()["resource_exhausted"] == outcomes.count("pushed back")
    finally:
        channel.close()
        proc.stop(2)
