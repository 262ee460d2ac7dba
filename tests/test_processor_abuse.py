"""The processor bounded under abuse: memory limiter, receive cap after decompression, auth
before the body, per-reporter quotas, bounded health server, clock steps, self-telemetry."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import tracemalloc
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from support.otlp_receiver import call
from support.processor import in_process_config, processor_cli
from support.strict_downstream import StrictDownstream
from support.synth import agent_request

from otel_gpu.detect.breaker import Breaker, BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import Point
from otel_gpu.processor import Downstream, Processor, ProcessorConfig
from otel_gpu.processor.assemble import Assembler
from otel_gpu.processor.decode import DEVICE, F_USED, MetricsDecoder, ResourceInfo
from otel_gpu.processor.memlimit import MemoryLimiter
from otel_gpu.processor.pipeline import Detection
from otel_gpu.processor.store import StateStore
from otel_gpu.processor.wire import METRICS_EXPORT

T0 = int((time.time() - 3600) * 1e9)
MIB = 1024 * 1024


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.unit
@pytest.mark.parametrize(
    ("readings", "limited"),
    [
        ([100 * MIB], False),
        ([799 * MIB], False),
        ([801 * MIB, 801 * MIB], True),  # above 80 % of 1000 MiB, still after releasing
        ([900 * MIB, 500 * MIB], False),  # releasing memory brought it back under
    ],
)
def test_memory_limiter_refuses_above_the_soft_limit(readings, limited):
    values = iter(readings)
    released = []
    lim = MemoryLimiter(1000 * MIB, read=lambda: next(values), release=lambda: released.append(1))
    assert lim.check() is limited
    assert bool(released) == (readings[0] > 800 * MIB)


def start(**kw) -> Processor:  # type: ignore[no-untyped-def]
    memory = kw.pop("memory", None)
    p = Processor(in_process_config(**kw), memory=memory)
    p.start()
    return p


def raw(k: int = 0, instance: str = "run-1") -> bytes:
    return agent_request(  # type: ignore[no-any-return]
        T0 + k * 15_000_000_000, gpus=1, processes=1, instance=instance
    ).SerializeToString()


@pytest.mark.process
def test_over_the_memory_limit_exports_are_refused_with_retry_info():
    rss = [100 * MIB]
    lim = MemoryLimiter(1000 * MIB, read=lambda: rss[0], release=lambda: None)
    proc = start(memory=lim)
    try:
        call(proc.address, METRICS_EXPORT, raw())
        rss[0] = 950 * MIB
        lim.check()
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, raw(1))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--memory-limit-mib" in e.value.details()
        assert "google.rpc.retryinfo-bin" in dict(e.value.trailing_metadata())
        assert proc.health()[0] is False and "memory" in proc.health()[1]
        rss[0] = 200 * MIB
        lim.check()
        call(proc.address, METRICS_EXPORT, raw(2))  # accepted again
        assert proc.stats()["signals"]["metrics"] == {"accepted": 2, "refused": 1}
    finally:
        proc.stop(2)


@pytest.mark.process
def test_the_receive_cap_holds_after_decompression():
    proc = start(max_recv_bytes=64 * 1024)
    try:
        bomb = b"\x00" * (1 * MIB)  # 1 MiB of zeros: about 1 kB on the wire with gzip
        assert len(gzip.compress(bomb)) < 64 * 1024
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, bomb, compression=grpc.Compression.Gzip)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call(proc.address, METRICS_EXPORT, raw())  # the service is unharmed
    finally:
        proc.stop(2)


@pytest.mark.process
def test_unauthenticated_calls_are_refused_before_their_body_is_read():
    proc = start(token="s3cret", max_recv_bytes=64 * 1024)
    try:
        # Over the receive cap *and* garbage: refused for the token, so the body was never read.
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, b"\xff" * (256 * 1024))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert proc.stats()["unauthenticated"] == 1
        call(proc.address, METRICS_EXPORT, raw(), metadata=[("authorization", "Bearer s3cret")])
    finally:
        proc.stop(2)


def _reporter(name: str) -> ResourceInfo:
    return ResourceInfo(f"host.name={name}", (("host.name", name),), f"host.name={name}")


@pytest.mark.unit
def test_one_reporter_cannot_fill_the_subject_cap_for_the_others():
    asm = Assembler(lambda s, p: None, max_series=1000, grace_s=1.0, ttl_s=3600.0, per_reporter=100)
    bomb = _reporter("bomb")
    refused = sum(asm.target(bomb, DEVICE, f"GPU-{i}", None, F_USED) is None for i in range(5000))
    assert refused == 4900 and len(asm) == 100
    good = [_reporter(f"node-{n}") for n in range(8)]
    assert all(asm.target(r, DEVICE, f"GPU-{g}", None, F_USED) for r in good for g in range(8))
    assert len(asm) == 100 + 64


@pytest.mark.unit
def test_overflow_counts_each_refused_point_once():
    det = Detection(
        ProcessorConfig(max_series=2),
        Engine(),
        Breaker(BreakerConfig()),
        StateStore(None),
        None,
        lambda m, b: None,
    )
    # 1 GPU + 1 process: gpu, process_gpu, process_rss subjects; the cap of 2 refuses one.
    det.ingest_metrics(raw(0))
    first = det.stats().overflow
    det.ingest_metrics(raw(1))
    assert first >= 1 and det.stats().overflow == 2 * first


@pytest.mark.unit
def test_a_wall_clock_step_evicts_nothing_and_judgement_stays_on_data_time():
    wall, mono = Clock(time.time()), Clock(1000.0)
    seen: list[Point] = []

    class Recording(Engine):
        def observe(self, subject, point):  # type: ignore[no-untyped-def]
            seen.append(point)
            return super().observe(subject, point)

    det = Detection(
        ProcessorConfig(assemble_grace_s=1.0),
        Recording(),
        Breaker(BreakerConfig()),
        StateStore(None),
        None,
        lambda m, b: None,
        wall=wall,
        clock=mono,
    )
    det.ingest_metrics(raw(0))
    subjects = det.stats().subjects
    assert subjects >= 2
    wall.t += 32 * 60  # NTP steps the wall clock forward 32 minutes (> the 30 min TTL)
    mono.t += 31  # half a minute of real time: eviction is looked at
    det.tick()
    assert det.stats().subjects == subjects
    assert seen and {p.time for p in seen} == {T0 / 1e9}  # judged at the data's own time


@pytest.mark.process
def test_health_server_threads_stay_bounded_under_idle_connections():
    proc = start(health="127.0.0.1:0", health_max_connections=8)
    host, port = proc.health_address.rsplit(":", 1)
    before = threading.active_count()
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection((host, int(port)))
            socks.append(s)
        time.sleep(0.3)
        assert threading.active_count() - before <= 8
    finally:
        for s in socks:
            s.close()
    try:
        deadline = time.monotonic() + 10
        while True:  # the idle slots free up (closed by the clients or the idle timeout)
            try:
                with urllib.request.urlopen(
                    f"http://{proc.health_address}/healthz", timeout=3
                ) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.stop(2)


@pytest.mark.process
def test_self_telemetry_goes_downstream_as_otlp_metrics():
    down = StrictDownstream()
    proc = start(forward=(Downstream(down.address),), telemetry_interval_s=0.2)
    try:
        call(proc.address, METRICS_EXPORT, raw())
        with pytest.raises(grpc.RpcError):
            call(proc.address, METRICS_EXPORT, b"\xff\xff")
        assert down.wait_for(lambda: down.count("") >= 1)  # the processor's own resource
        got: dict[str, float] = {}
        deadline = time.monotonic() + 10
        while "otel_gpu.processor.requests.refused" not in got:
            assert time.monotonic() < deadline
            for req in down.decoded():
                for rm in req.resource_metrics:
                    for m in rm.scope_metrics[0].metrics:
                        for dp in m.sum.data_points or m.gauge.data_points:
                            a = {kv.key: kv.value.string_value for kv in dp.attributes}
                            if a.get("signal", "metrics") == "metrics":
                                got[m.name] = dp.as_int or dp.as_double
            time.sleep(0.1)
        assert got["otel_gpu.processor.requests.accepted"] >= 1
        assert got["otel_gpu.processor.requests.refused"] == 1
        assert "otel_gpu.processor.forward.queue.size" in got
        assert "otel_gpu.processor.store.errors" in got
        assert "otel_gpu.processor.memory.limited" in got
    finally:
        proc.stop(2)
        down.close()


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--memory-limit-mib", "10"], "--memory-limit-mib='10': use 0 (off) or a whole number"),
        (["--max-recv-mib", "0"], "--max-recv-mib='0': use a size in MiB from 0.001 to 2047"),
        (["--max-series-per-reporter", "0"], "--max-series-per-reporter='0': use a whole number"),
        (["--queue-dir", "/dev/null/q"], "--queue-dir='/dev/null/q': cannot keep a queue there"),
        (["--telemetry-interval", "-1"], "--telemetry-interval='-1': use a number of seconds >= 0"),
    ],
)
def test_bad_limits_are_one_line_usage_errors(args, fragment):
    r = processor_cli("--forward", "127.0.0.1:9", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in r.stderr


@pytest.mark.unit
def test_the_resource_cache_is_bounded_in_bytes_not_only_entries():
    asm = Assembler(lambda s, p: None, max_series=10_000, grace_s=1.0, ttl_s=3600.0)
    dec = MetricsDecoder(946_684_800.0, 3600.0, cache_bytes=4 * MIB)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for n in range(40):  # 40 requests, each with its own 1 MiB resource
            req = agent_request(T0, gpus=1, processes=0, instance=f"big-{n}")
            req.resource_metrics[0].resource.attributes.append(
                KeyValue(key="blob", value=AnyValue(string_value="x" * MIB))
            )
            body = req.SerializeToString()
            del req
            dec.decode(body, asm, int(time.time() * 1e9))
            del body
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held < 8 * MIB  # not 40 MiB of cached resources


@pytest.mark.process
def test_empty_envelopes_are_accepted_and_dropped():
    down = StrictDownstream()
    proc = start(forward=(Downstream(down.address),))
    try:
        req = ExportMetricsServiceRequest()
        rm = req.resource_metrics.add()
        rm.resource.attributes.add(key="service.instance.id").value.string_value = "empty"
        rm.scope_metrics.add().metrics.add(name="no.points")
        assert call(proc.address, METRICS_EXPORT, req.SerializeToString())[0] == b""
        call(proc.address, METRICS_EXPORT, raw())  # a real one, to know forwarding works
        assert down.wait_for(lambda: down.count("run-1") == 1)
        assert down.count("empty") == 0 and proc.stats()["empty_requests"] == 1
    finally:
        proc.stop(2)
        down.close()


@pytest.mark.process
def test_deeply_nested_attribute_values_are_refused_and_the_service_lives():
    # AnyValue{kvlist_value{values[KeyValue{key, value: AnyValue{...}}]}} nested 300 deep.
    value = b"\x0a\x01x"  # AnyValue{string_value: "x"}
    for _ in range(300):
        kv = b"\x0a\x01k" + b"\x12" + _varint(len(value)) + value  # KeyValue{key, value}
        kvlist = b"\x0a" + _varint(len(kv)) + kv  # KeyValueList{values}
        value = b"\x32" + _varint(len(kvlist)) + kvlist  # AnyValue{kvlist_value (6)}
    attr = b"\x0a\x04deep\x12" + _varint(len(value)) + value
    resource = b"\x0a" + _varint(len(attr)) + attr
    rm = b"\x0a" + _varint(len(resource)) + resource
    body = b"\x0a" + _varint(len(rm)) + rm
    proc = start()
    try:
        with pytest.raises(grpc.RpcError) as e:
            call(proc.address, METRICS_EXPORT, body)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        call(proc.address, METRICS_EXPORT, raw())
    finally:
        proc.stop(2)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.unit
def test_a_cardinality_bomb_through_the_decoder_counts_each_refused_point_once():
    det = Detection(
        ProcessorConfig(max_series_per_reporter=100),
        Engine(),
        Breaker(BreakerConfig()),
        StateStore(None),
        None,
        lambda m, b: None,
    )
    req = agent_request(T0, gpus=1, processes=0, instance="bomb")
    metric = next(
        m
        for m in req.resource_metrics[0].scope_metrics[0].metrics
        if m.name == "hw.gpu.memory.usage"
    )
    for i in range(5000):
        dp = metric.sum.data_points.add(time_unix_nano=T0, as_int=1 << 30)
        dp.attributes.append(KeyValue(key="hw.id", value=AnyValue(string_value=f"X-{i}")))
    det.ingest_metrics(req.SerializeToString())
    # GPU-0 and 99 of the made-up GPUs fill the reporter's quota of 100 subjects.
    assert det.stats().overflow == 5000 - 99 and det.stats().subjects == 100
    det.ingest_metrics(raw(0, instance="legit"))  # another reporter is tracked in full
    assert det.stats().subjects == 100 + 3
