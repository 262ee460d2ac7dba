"""The processor's decode -> assemble -> detect path, driven in-process with encoded requests."""

from __future__ import annotations

import math
import time

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from support.processor import in_process_config, leak_requests
from support.synth import GIB, agent_request, default_value, gpu_uuid

from otel_gpu.core.addresses import parse_hostport
from otel_gpu.core.errors import UsageError
from otel_gpu.detect.breaker import OPEN, Breaker, BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import Point
from otel_gpu.processor.assemble import Assembler, Subject
from otel_gpu.processor.decode import MetricsDecoder, strip_rejected
from otel_gpu.processor.pipeline import Detection
from otel_gpu.processor.settings import Downstream, ProcessorConfig
from otel_gpu.processor.store import StateStore

pytestmark = pytest.mark.unit

T0 = int((time.time() - 3600) * 1e9)
NOW = time.time()


def assemble(*requests: bytes, grace_s: float = 1.0, max_series: int = 1000):
    """Decode ``requests`` and return the emitted (subject, point) pairs after a final flush."""
    out: list[tuple[Subject, Point]] = []
    asm = Assembler(lambda s, p: out.append((s, p)), max_series, grace_s, 3600.0)
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    for raw in requests:
        dec.decode(raw, asm, int(NOW * 1e9))
    asm.flush_due(NOW, all_pending=True)
    return out, asm


def by_kind(pairs, kind):
    return [(s, p) for s, p in pairs if s.kind == kind]


def test_agent_payload_becomes_one_point_per_subject_with_the_detector_fields():
    raw = agent_request(T0, gpus=2, processes=3).SerializeToString()
    pairs, _ = assemble(raw)
    gpus = by_kind(pairs, "gpu")
    assert len(gpus) == 2
    s, p = gpus[0]
    assert s.hw_id == gpu_uuid(0) and "host.name=node-1" in s.name
    assert p.time == pytest.approx(T0 / 1e9)
    assert (p.used_bytes, p.limit_bytes) == (60 * GIB, 80 * GIB)
    assert p.util == pytest.approx(0.93)  # the "general" task, not encoder/decoder (0.0)
    assert (p.power_w, p.power_limit_w, p.temperature_c) == (610.0, 700.0, 71.0)
    assert (p.ecc_uncorrected, p.xid_errors) == (0.0, 0.0)
    # processes 0 and 2 sit on GPU 0 (p % gpus), process 1 on GPU 1
    assert [pt.procs for _, pt in gpus] == [2, 1]
    procs = by_kind(pairs, "process_gpu")
    assert len(procs) == 3
    s, p = procs[0]
    assert (s.pid, s.hw_id) == (10_000, gpu_uuid(0))
    assert p.used_bytes == 7 * GIB and p.limit_bytes == 80 * GIB and p.util is None
    rss = by_kind(pairs, "process_rss")
    assert [p.used_bytes for _, p in rss] == [3 * GIB] * 3
    assert len(pairs) == 2 + 3 + 3  # nothing else becomes a subject


def test_a_collection_split_over_two_requests_is_judged_as_one_point():
    full = agent_request(T0, gpus=1, processes=0)
    first, second = ExportMetricsServiceRequest(), ExportMetricsServiceRequest()
    first.CopyFrom(full)
    second.CopyFrom(full)
    names = [m.name for m in full.resource_metrics[0].scope_metrics[0].metrics]
    half = len(names) // 2
    del first.resource_metrics[0].scope_metrics[0].metrics[half:]
    del second.resource_metrics[0].scope_metrics[0].metrics[:half]
    pairs, asm = assemble(first.SerializeToString(), second.SerializeToString())
    ((_, p),) = by_kind(pairs, "gpu")
    assert p.util is not None and p.used_bytes is not None and p.temperature_c is not None
    assert asm.late == 0


def test_points_older_than_the_subject_latest_are_late_and_dropped():
    newer = agent_request(T0 + 10**10, gpus=1, processes=0).SerializeToString()
    older = agent_request(T0, gpus=1, processes=0).SerializeToString()
    pairs, asm = assemble(newer, older)
    assert [p.time for _, p in by_kind(pairs, "gpu")] == [pytest.approx((T0 + 10**10) / 1e9)]
    assert asm.late > 0


def test_pending_point_waits_for_the_grace_time_then_is_emitted():
    out: list[Point] = []
    asm = Assembler(lambda s, p: out.append(p), 100, grace_s=1.0, ttl_s=60.0)
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    asm.now = 100.0
    dec.decode(agent_request(T0, gpus=1, processes=0).SerializeToString(), asm, int(NOW * 1e9))
    asm.flush_due(100.5)
    assert out == []
    asm.flush_due(101.0)
    assert len(out) == 1


def test_series_cap_counts_overflow_and_eviction_frees_room():
    raw = agent_request(T0, gpus=4, processes=0).SerializeToString()
    pairs, asm = assemble(raw, max_series=2)
    assert len(by_kind(pairs, "gpu")) == 2 and asm.overflow > 0
    asm.now = 10_000.0 + NOW
    gone = asm.evict(asm.now)
    assert len(gone) == 2 and len(asm) == 0


def _kv(k, v):
    return KeyValue(key=k, value=AnyValue(string_value=v))


def test_bad_points_are_rejected_counted_and_cut_from_the_forwarded_copy():
    req = agent_request(T0, gpus=2, processes=0)
    metrics = req.resource_metrics[0].scope_metrics[0].metrics
    usage = next(m for m in metrics if m.name == "hw.gpu.memory.usage")
    usage.sum.data_points[0].as_double = math.nan
    power = next(m for m in metrics if m.name == "hw.power")
    power.gauge.data_points[1].as_double = math.inf
    temp = next(m for m in metrics if m.name == "hw.temperature")
    temp.gauge.data_points[0].time_unix_nano = int((NOW + 10 * 86400) * 1e9)  # absurd future
    energy = next(m for m in metrics if m.name == "hw.energy")
    energy.sum.data_points[0].as_double = math.nan  # not a detector series: not judged
    raw = req.SerializeToString()
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    out: list = []
    decoded = dec.decode(raw, Assembler(lambda s, p: out.append(p), 10, 1.0, 60.0), int(NOW * 1e9))
    assert decoded.rejected == 3
    assert "not a finite number" in decoded.first_error
    cleaned = ExportMetricsServiceRequest.FromString(strip_rejected(raw, decoded.bad))
    cm = {m.name: m for m in cleaned.resource_metrics[0].scope_metrics[0].metrics}
    assert len(cm["hw.gpu.memory.usage"].sum.data_points) == 1
    assert len(cm["hw.power"].gauge.data_points) == 1
    assert len(cm["hw.temperature"].gauge.data_points) == 1
    assert math.isnan(cm["hw.energy"].sum.data_points[0].as_double)  # forwarded untouched
    assert len(cm["hw.gpu.utilization"].gauge.data_points) == 6


def test_garbage_and_broken_metric_data_raise_decode_error():
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    sink = Assembler(lambda s, p: None, 10, 1.0, 60.0)
    with pytest.raises(DecodeError):
        dec.decode(b"\xff\xff\xff\xff", sink, int(NOW * 1e9))
    req = ExportMetricsServiceRequest()
    m = req.resource_metrics.add().scope_metrics.add().metrics.add(name="hw.power")
    m.gauge.data_points.add(time_unix_nano=T0, as_double=1.0)
    raw = bytearray(req.SerializeToString())
    raw[-3] = 0xFF  # corrupt inside the point
    with pytest.raises(DecodeError):
        dec.decode(bytes(raw) + b"\x0f", sink, int(NOW * 1e9))


def test_huge_attribute_sets_and_unknown_types_are_survived():
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend(_kv(f"k{i}", "v" * 50) for i in range(5000))
    sm = rm.scope_metrics.add()
    h = sm.metrics.add(name="hw.gpu.memory.usage")  # a detector name with a histogram
    h.histogram.data_points.add(time_unix_nano=T0, count=3)
    s = sm.metrics.add(name="process.memory.usage")
    s.summary.data_points.add(time_unix_nano=T0, count=1)
    g = sm.metrics.add(name="hw.power")
    dp = g.gauge.data_points.add(time_unix_nano=T0, as_double=300.0)
    dp.attributes.extend(_kv(f"a{i}", "x") for i in range(5000))
    dp.attributes.append(_kv("hw.id", "G" * 10_000))
    pairs, _ = assemble(req.SerializeToString())
    ((subject, point),) = pairs
    assert point.power_w == 300.0 and len(subject.hw_id or "") <= 130  # cut, not 10 kB names


def test_leak_fed_through_detection_opens_the_breaker_and_persists(tmp_path):
    db = str(tmp_path / "state.db")
    sent: list[tuple[str, bytes]] = []
    cfg = in_process_config(state_path=db)
    bcfg = BreakerConfig(cooldown_s=1e6)
    store = StateStore(db)
    det = Detection(cfg, Engine(), Breaker(bcfg), store, None, lambda m, b: sent.append((m, b)))
    for raw in leak_requests(600):
        det.ingest_metrics(raw)
    det.tick(final=True)
    assert det.stats().alerts >= 1
    opened = [s for s in det.breaker.subjects() if det.breaker.state(s) == OPEN]
    assert opened and any("pid 10000 gpu" in s for s in opened)
    store.close()
    again = StateStore(db)
    restored = Breaker.from_state(again.load_breaker() or {}, bcfg)
    assert {s for s in restored.subjects() if restored.state(s) == OPEN} == set(opened)
    rows = again.history("transitions")
    assert rows and rows[0]["to_state"] == OPEN
    again.close()


@pytest.mark.parametrize(
    "value",
    ["localhost", "127.0.0.1:", ":4317", "127.0.0.1:70000", "a b:1", "[::1:4317", "host:port"],
)
def test_bad_addresses_are_usage_errors(value):
    with pytest.raises(UsageError, match=r"^--listen='.*': use HOST:PORT with a port from 0"):
        parse_hostport(value, "--listen")


def test_config_parses_addresses_and_rejects_half_tls():
    assert parse_hostport("[::1]:4317", "--listen") == ("::1", 4317)
    assert Downstream.parse("https://collector.example:4317") == Downstream(
        "collector.example:4317", True
    )
    with pytest.raises(UsageError, match="tls_cert='c.pem': a TLS certificate and its key go"):
        ProcessorConfig(tls_cert="c.pem")
    with pytest.raises(UsageError, match="max_series=0: use a whole number, 1 or more"):
        ProcessorConfig(max_series=0)


def test_default_value_table_matches_the_agent_payload_helper():
    # Guard for the benchmark and tests: the synthetic agent stays a healthy node.
    assert default_value("hw.gpu.utilization", 0, {"hw.gpu.task": "general"}) == 0.93


def _job_request(time_ns: int, pid: int, phase: str, step: int, torch_bytes: float):
    """What a trainer process reports: training.* and torch allocator bytes (tracing.progress)."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for k, v in (
        ("service.name", "trainer"),
        ("service.instance.id", "run-1"),
        ("host.name", "node-1"),
    ):
        rm.resource.attributes.append(_kv(k, v))
    rm.resource.attributes.append(KeyValue(key="process.pid", value=AnyValue(int_value=pid)))
    sm = rm.scope_metrics.add()
    ph = sm.metrics.add(name="training.phase")
    for name in ("load", "train", "evaluate", "save"):
        dp = ph.gauge.data_points.add(time_unix_nano=time_ns, as_int=int(name == phase))
        dp.attributes.append(_kv("training.phase", name))
    sm.metrics.add(name="training.step").sum.data_points.add(time_unix_nano=time_ns, as_int=step)
    alloc = sm.metrics.add(name="torch.cuda.memory.allocated")
    dp = alloc.sum.data_points.add(time_unix_nano=time_ns, as_int=int(torch_bytes))
    dp.attributes.append(_kv("hw.id", gpu_uuid(0)))
    dp.attributes.append(KeyValue(key="gpu.index", value=AnyValue(int_value=0)))
    return req.SerializeToString()


def test_phase_step_and_torch_bytes_of_a_trainer_reach_the_job_gpus():
    # the agent (pid 4242 in its resource) reports the GPUs; the trainer (pid 77) its phase
    trainer = _job_request(T0, 77, "evaluate", 1200, 5 * GIB)
    agent = agent_request(T0, gpus=1, processes=0).SerializeToString()
    pairs, _ = assemble(trainer, agent)
    ((_, gpu),) = by_kind(pairs, "gpu")
    assert (gpu.phase, gpu.step) == ("evaluate", 1200)
    ((torch_subject, torch_point),) = by_kind(pairs, "torch")
    assert torch_point.used_bytes == 5 * GIB and torch_point.phase == "evaluate"
    assert torch_subject.name.endswith(f"process.pid=77 torch gpu {gpu_uuid(0)}")
    assert ("hw.id", gpu_uuid(0)) in torch_subject.attrs


def test_a_restart_does_not_resolve_a_leak_that_is_still_going(tmp_path):
    """The engine's evidence dies with the process, the breaker survives in the store: a
    breaker held open by a leak stays open after a restart while the leak goes on (it is not
    probed and closed as if the leak had stopped)."""
    db = str(tmp_path / "state.db")
    cfg = in_process_config(state_path=db)
    bcfg = BreakerConfig(cooldown_s=600, probation_s=300)
    t0 = time.time() - 6 * 3600
    store = StateStore(db)
    det = Detection(cfg, Engine(), Breaker(bcfg), store, None, lambda m, b: None)
    for raw in leak_requests(900, start_s=t0):  # 3.75 h of a leak
        det.ingest_metrics(raw)
    det.tick(final=True)
    opened = {s for s in det.breaker.subjects() if det.breaker.state(s) == OPEN}
    assert opened
    store.close()

    again = StateStore(db)
    restored = Breaker.from_state(again.load_breaker() or {}, bcfg)
    det = Detection(cfg, Engine(), restored, again, None, lambda m, b: None)
    for raw in leak_requests(480, start_s=t0, first=900):  # 2 h more, still leaking
        det.ingest_metrics(raw)
    det.tick(final=True)
    assert {s for s in opened if det.breaker.state(s) == OPEN} == opened
    assert [r["to_state"] for r in again.history("transitions")] == [OPEN] * len(opened)
    again.close()
