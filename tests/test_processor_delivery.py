"""Nothing the processor accepted is lost: validation before acceptance, one client's refused
data never costs another's, downstream partial_success counted, and the disk queue
(--queue-dir) delivering across an outage and a kill -9, every accepted request once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from support.otlp_receiver import call
from support.ports import free_port
from support.processor import ProcessorProcess, in_process_config
from support.strict_downstream import REJECT_KEY, StrictDownstream
from support.synth import agent_request

from otel_gpu.core.errors import UsageError
from otel_gpu.processor import Downstream, Processor
from otel_gpu.processor.forward import backoff
from otel_gpu.processor.queue import DiskQueue
from otel_gpu.processor.wire import METRICS_EXPORT

T0 = int((time.time() - 3600) * 1e9)


def request(instance: str, k: int = 0, mark: bool = False) -> bytes:
    req = agent_request(T0 + k * 15_000_000_000, gpus=1, processes=1, instance=instance)
    if mark:
        req.resource_metrics[0].resource.attributes.append(
            KeyValue(key=REJECT_KEY, value=AnyValue(string_value="1"))
        )
    return req.SerializeToString()  # type: ignore[no-any-return]


def invalid_resource(instance: str) -> bytes:
    """A request whose Resource field holds bytes that are not a Resource (bad UTF-8 in a key)."""
    good = ExportMetricsServiceRequest.FromString(request(instance))
    good.resource_metrics[0].ClearField("resource")
    body = good.SerializeToString()
    # resource_metrics[0] is field 1 of the request; prepend field 1 (resource) to its body:
    # a KeyValue whose key is the invalid UTF-8 byte 0xff.
    bad_kv = b"\x0a\x01\xff"
    bad_resource = b"\x0a" + bytes([len(bad_kv)]) + bad_kv
    rm = ExportMetricsServiceRequest.FromString(body).resource_metrics[0].SerializeToString()
    rm = b"\x0a" + bytes([len(bad_resource)]) + bad_resource + rm
    return b"\x0a" + _varint(len(rm)) + rm


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def eventually(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def strict() -> Iterator[StrictDownstream]:
    d = StrictDownstream()
    yield d
    d.close()


def start(down: StrictDownstream | None, **overrides) -> Processor:  # type: ignore[no-untyped-def]
    forward = (Downstream(down.address),) if down else ()
    cfg = in_process_config(
        forward=overrides.pop("forward", forward),
        forward_retry_s=overrides.pop("forward_retry_s", 5.0),
        **overrides,
    )
    p = Processor(cfg)
    p.start()
    return p


@pytest.mark.process
def test_a_resource_that_is_not_a_resource_is_refused_and_costs_no_one_else(strict):
    proc = start(strict)
    try:
        accepted = 0
        for k in range(60):
            call(proc.address, METRICS_EXPORT, request("good", k))
            accepted += 1
            if k % 3 == 0:
                with pytest.raises(grpc.RpcError) as e:
                    call(proc.address, METRICS_EXPORT, invalid_resource("bad"))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert strict.wait_for(lambda: strict.count("good") == accepted)
        assert strict.count("bad") == 0 and strict.refused == 0
        assert proc.stats()["signals"]["metrics"]["refused"] == 20
    finally:
        proc.stop(2)


@pytest.mark.process
def test_a_merged_call_the_downstream_refuses_is_resent_request_by_request(strict):
    # Valid OTLP that this downstream refuses by its own rule: merged with good requests, the
    # whole call fails; the good ones must still arrive, the refused one is counted.
    proc = start(strict)
    try:
        payloads = [request(f"c{i}", i, mark=(i == 5)) for i in range(12)]
        # Submitted together, so the forwarder merges them into one call.
        for p in payloads:
            proc._send(METRICS_EXPORT, p)
        assert strict.wait_for(lambda: sum(strict.resources[METRICS_EXPORT].values()) == 11)
        assert all(strict.count(f"c{i}") == 1 for i in range(12) if i != 5)
        assert strict.refused >= 2  # the merged call, then the marked request alone
        assert eventually(lambda: proc.stats()["forward"][strict.address]["sent"] == 11)
        fwd = proc.stats()["forward"][strict.address]
        assert fwd["dropped"] == 1 and fwd["failed"] >= 1
    finally:
        proc.stop(2)


@pytest.mark.process
def test_partial_success_from_the_downstream_is_counted_and_logged_once(caplog):
    down = StrictDownstream(partial_rejected=3)
    proc = start(down)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_gpu.processor.forward"):
            for k in range(4):
                call(proc.address, METRICS_EXPORT, request("a", k))
                assert down.wait_for(lambda k=k: down.count("a") == k + 1)
            assert eventually(
                lambda: proc.stats()["forward"][down.address]["partial_rejected"] == 12
            )
        warnings = [r for r in caplog.records if "rejected 3 items" in r.getMessage()]
        assert len(warnings) == 1 and "too old" in warnings[0].getMessage()
    finally:
        proc.stop(2)
        down.close()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("attempt", "rand", "delay"),
    [(0, 0.0, 0.25), (0, 1.0, 0.75), (1, 0.5, 1.0), (3, 0.5, 4.0), (10, 0.0, 5.0), (10, 1.0, 15.0)],
)
def test_retry_backoff_is_exponential_capped_and_jittered(attempt, rand, delay):
    assert backoff(attempt, rand) == pytest.approx(delay)


@pytest.mark.process
def test_sdk_exporter_to_strict_downstream_delivers_every_accepted_export(strict):
    """End to end: OTel SDK exporter -> processor -> a downstream that decodes everything."""
    proc = start(strict)
    try:
        providers = []
        for i in range(3):
            exporter = OTLPMetricExporter(endpoint=proc.address, insecure=True, timeout=5)
            reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
            res = Resource.create({"service.name": "sdk", "service.instance.id": f"sdk-{i}"})
            mp = MeterProvider(resource=res, metric_readers=[reader])
            gauge = mp.get_meter("t").create_gauge("hw.gpu.utilization", unit="1")
            providers.append((mp, gauge))
        for k in range(10):
            for mp, gauge in providers:
                gauge.set(0.5 + k / 100, {"hw.id": "GPU-1", "hw.gpu.task": "general"})
                assert mp.force_flush(10_000)
        accepted = proc.stats()["signals"]["metrics"]["accepted"]
        assert accepted == 30
        assert strict.wait_for(lambda: sum(strict.resources[METRICS_EXPORT].values()) == 30)
        assert all(strict.count(f"sdk-{i}") == 10 for i in range(3))
        for mp, _ in providers:
            mp.shutdown()
    finally:
        proc.stop(2)


@pytest.mark.process
def test_disk_queue_delivers_across_an_outage_and_a_kill_9(tmp_path):
    """The Collector testbed's pattern: downstream down, queue fills, processor killed -9,
    restarted, downstream up: every accepted request delivered once."""
    port = free_port()
    qdir = str(tmp_path / "queue")
    args = ["--listen", "127.0.0.1:0", "--forward", f"127.0.0.1:{port}", "--queue-dir", qdir]
    first = ProcessorProcess(*args)
    accepted = 0
    try:
        for k in range(40):
            call(first.address, METRICS_EXPORT, request("durable", k))
            accepted += 1
    finally:
        first.kill()  # SIGKILL: no flush, no shutdown
    down = StrictDownstream(port)
    second = ProcessorProcess(*args)
    try:
        assert "40 requests from before a restart" in second.output or down.wait_for(
            lambda: down.count("durable") > 0
        )
        assert down.wait_for(lambda: down.count("durable") == accepted, timeout=30)
        time.sleep(0.5)  # nothing more arrives: each was delivered once
        assert down.count("durable") == accepted
    finally:
        second.terminate()
        down.close()


@pytest.mark.unit
def test_a_full_disk_queue_refuses_and_counts(tmp_path):
    q = DiskQueue(str(tmp_path / "q.sqlite"), max_bytes=1000)
    assert q.put(METRICS_EXPORT, b"x" * 600)
    assert not q.put(METRICS_EXPORT, b"y" * 600)  # over its size bound
    assert len(q) == 1 and q.bytes() == 600
    q.close()
    again = DiskQueue(str(tmp_path / "q.sqlite"), max_bytes=1000)
    ((_, method, payload),) = again.peek(10, 1 << 20)
    assert (method, payload) == (METRICS_EXPORT, b"x" * 600)
    again.close()


@pytest.mark.unit
def test_a_damaged_disk_queue_is_moved_aside_and_a_fresh_one_begins(tmp_path, caplog):
    path = tmp_path / "q.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    with caplog.at_level(logging.WARNING):
        q = DiskQueue(str(path), max_bytes=1 << 20)
    assert q.put(METRICS_EXPORT, b"ok") and len(q) == 1
    assert any("moved it to" in r.getMessage() for r in caplog.records)
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    q.close()


@pytest.mark.process
def test_testbed_outage_refusals_while_the_disk_queue_is_full_are_all_delivered_later(tmp_path):
    """checklist 39/40: downstream down, the disk queue fills, the processor refuses with a
    retry delay (nothing accepted then dropped), the client retries what was refused; once the
    downstream is back every request arrives exactly once."""
    port = free_port()
    size = len(request("tb", 0))
    proc = start(
        None,
        forward=(Downstream(f"127.0.0.1:{port}"),),
        queue_dir=str(tmp_path / "q"),
        queue_dir_bytes=10 * size + size // 2,
    )
    pending = [request("tb", k) for k in range(30)]
    refused_seen = False
    down = None
    try:
        deadline = time.monotonic() + 60
        while pending:
            assert time.monotonic() < deadline
            retry = []
            for p in pending:
                try:
                    call(proc.address, METRICS_EXPORT, p)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "disk queue" in e.details()
                    refused_seen = True
                    retry.append(p)
            pending = retry
            if refused_seen and down is None:
                down = StrictDownstream(port)  # the outage ends
            time.sleep(0.2)
        assert refused_seen
        assert down is not None and down.wait_for(lambda: down.count("tb") == 30, timeout=30)
        time.sleep(0.3)
        assert down.count("tb") == 30
        assert proc.stats()["forward"][f"127.0.0.1:{port}"]["dropped"] == 0
    finally:
        proc.stop(2)
        if down is not None:
            down.close()


@pytest.mark.process
def test_unknown_fields_are_accepted_and_forwarded_byte_for_byte(strict):
    # Forward compatibility (checklist 37): a field this OTLP version does not know.
    body = request("fwd", 0) + b"\xfa\x3e\x03abc"  # field 999, length-delimited
    proc = start(strict)
    try:
        call(proc.address, METRICS_EXPORT, body)
        assert strict.wait_for(lambda: strict.count("fwd") == 1)
    finally:
        proc.stop(2)


@pytest.mark.process
def test_a_non_utf8_attribute_value_is_refused_whole():
    # checklist 38: a strict downstream cannot decode it, so it is never accepted.
    req = ExportMetricsServiceRequest.FromString(request("utf", 0))
    m = req.resource_metrics[0].scope_metrics[0].metrics[0]
    points = m.gauge.data_points or m.sum.data_points
    points[0].attributes.append(KeyValue(key="note", value=AnyValue(string_value="PLACEHOLDER")))
    body = req.SerializeToString().replace(
        b"PLACEHOLDER", b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\xf7\xf6\xf5"
    )
    proc = start(None)
    try:
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, body)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        proc.stop(2)


@pytest.mark.process
def test_a_queue_dir_in_use_by_another_processor_is_a_usage_error(tmp_path):
    cfg = dict(forward=(Downstream("127.0.0.1:9"),), queue_dir=str(tmp_path))
    first = start(None, **cfg)
    try:
        with pytest.raises(UsageError, match="another processor is using it"):
            Processor(in_process_config(**cfg))
    finally:
        first.stop(1)
    Processor(in_process_config(**cfg)).stop(1)  # type: ignore[arg-type]
