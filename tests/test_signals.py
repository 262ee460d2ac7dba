"""The signal contract: what the project exports (the agent, the trainer, the sidecar's
inference and Kubernetes instruments, the processor), what the processor routes and what the
engine reads are the same declarations, checked through the real OTel SDK and OTLP encoding.

A renamed instrument, a unit changed on one side, a metric exported but undeclared (or declared
but never exported, or missing from the tables of the README and docs/), a route to a metric nobody exports or a Point
field no signal feeds fails here instead of leaving fleet detection blind.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.point import Gauge, Sum
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from support.docs import reference_lines
from support.processor import in_process_config
from support.snapshots import leak_snapshots

from otel_gpu.actions.span_event import alert_attributes
from otel_gpu.agent import instruments as metrics
from otel_gpu.agent import selfmetrics
from otel_gpu.agent.points import snapshot_points
from otel_gpu.agent.selfmetrics import ExportHealth
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.core import signals
from otel_gpu.core.signals import attributes
from otel_gpu.detect.breaker import Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import LEAK, NUMERIC_FIELDS, Alert, Point
from otel_gpu.inference.engines import parse_exposition
from otel_gpu.inference.scrape import ServerScraper
from otel_gpu.k8s.attribution import NodeAttribution
from otel_gpu.k8s.node_map import map_node
from otel_gpu.k8s.podresources import Allocation
from otel_gpu.processor import Downstream, Processor, outputs
from otel_gpu.processor.assemble import Assembler, Subject
from otel_gpu.processor.decode import ROUTES, MetricsDecoder
from otel_gpu.processor.telemetry import self_metrics_request
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.sim import SimulatedSource
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

GIB = 1 << 30
UUID = "GPU-5e1f4c2a-9b7d-4e3f-8a1b-000000000000"
Exported = dict[str, tuple[str, str]]  # metric name -> (unit, contract kind)


def _kind(data: Any) -> str:
    if isinstance(data, Gauge):
        return signals.GAUGE
    assert isinstance(data, Sum)
    return signals.COUNTER if data.is_monotonic else signals.UPDOWN


def _exported(data: MetricsData | None) -> Exported:
    return {
        m.name: (m.unit, _kind(m.data))
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for m in sm.metrics
    }


def _agent_table(snap: Snapshot) -> MetricsData | None:
    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: snap)
    return reader.get_metrics_data()


# The trainer's own instruments, in a child process (progress keeps the step and phase in
# module state): training progress, and torch's allocator as a CUDA build of torch on one
# initialized device reports it (there is no GPU here: the stand-in answers the same calls).
TRAINER = textwrap.dedent(
    """
    import json
    import time
    from types import SimpleNamespace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from otel_gpu.tracing import progress

    stats = {"allocated_bytes.all.current": 3, "reserved_bytes.all.current": 4,
             "allocated_bytes.all.peak": 3}
    cuda = SimpleNamespace(
        is_initialized=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        memory_reserved=lambda i: 4, memory_stats=lambda i: stats,
        get_device_properties=lambda i: SimpleNamespace(uuid="5e1f"),
    )
    torch = SimpleNamespace(version=SimpleNamespace(cuda="12.4"), cuda=cuda)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    assert progress.register(provider) and progress.register_torch(torch, provider)
    from otel_gpu.tracing import collective_timing
    dist = SimpleNamespace(barrier=lambda group=None, async_op=False: time.sleep(0.002))
    assert collective_timing.install(dist)  # the step splits into collective wait and work
    progress.set_step(2)
    time.sleep(0.01)
    dist.barrier()
    progress.set_step(3)
    progress.set_numbers({"loss": 1.5, "lr": 1e-4, "grad_norm": 2.0, "samples": 8, "tokens": 64})
    progress.push_phase("train")
    from opentelemetry import metrics
    from otel_gpu import MemTracker
    metrics.set_meter_provider(provider)  # MemTracker's gauges go to the global provider
    tracker = MemTracker(interval_ms=50).start()
    tracker.stop()
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = type(m.data).__name__
                monotonic = getattr(m.data, "is_monotonic", None)
                out[m.name] = [m.unit, kind, monotonic]
    print(json.dumps(out))
    """
)


def _trainer_exported() -> Exported:
    done = subprocess.run(
        [sys.executable, "-c", TRAINER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kinds = {
        ("Gauge", None): signals.GAUGE,
        ("Sum", True): signals.COUNTER,
        ("Sum", False): signals.UPDOWN,
    }
    found = json.loads(done.stdout)
    return {name: (unit, kinds[(kind, mono)]) for name, (unit, kind, mono) in found.items()}


def _everything_exported() -> Exported:
    """Every metric the project exports but the detector outputs (below): the instrument
    table over a full snapshot and the self-metrics reading the same snapshot (the agent), the
    trainer's progress and torch's allocator, the sidecar's inference-server and Kubernetes
    instruments, and the processor's own telemetry."""
    gpu = GpuSample(**{f.name: _value(f) for f in dataclasses.fields(GpuSample)})
    snap = Snapshot(
        time=1.0,
        gpus=(gpu,),
        gpu_processes=(GpuProcessSample(pid=7, gpu_uuid=UUID, used_memory=GIB, sm_util=0.5),),
        processes=(ProcessSample(pid=7, **_process_values()),),
        sweep_seconds=0.02,
        nvml_errors=(("TIMEOUT", 1),),
        intervals=(("gpu", 1.0), ("process_details", 4.0)),
    )
    return (
        _exported(_agent_table(snap))
        | _exported(_self_metrics(snap))
        | _trainer_exported()
        | _inference_instruments()
        | _exported(_k8s_instruments(snap))
        | _processor_telemetry()
    )


def _collect(register: Callable[[Any], object]) -> MetricsData | None:
    """What a real SDK reader collects from the instruments ``register(meter)`` creates."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    register(provider.get_meter("t"))
    try:
        return reader.get_metrics_data()
    finally:
        provider.shutdown()


def _self_metrics(snap: Snapshot) -> MetricsData | None:
    sampler = Sampler(SimulatedSource(), None, interval_s=1.0)
    sampler.publish(snap)
    return _collect(lambda meter: selfmetrics.register(meter, sampler, ExportHealth()))


# Each engine's own exposition (as documented): vLLM has no queue time, Triton no KV cache.
VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 5.0
"""
TRITON = """\
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="resnet",version="1"} 2
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="resnet",version="1"} 1500000
"""


def _inference_instruments() -> Exported:
    exported: Exported = {}
    for text in (VLLM, TRITON):
        scraper = ServerScraper("http://127.0.0.1:9/metrics", interval_s=5.0)
        scraper.latest = parse_exposition(text, time.time())  # as scrape_once() keeps it
        exported |= _exported(_collect(scraper.register_instruments))
    return exported


def _k8s_instruments(snap: Snapshot) -> MetricsData | None:
    """The rows of one pairing: the GPU allocated to a pod, the process holding memory on a
    GPU no pod is allocated (here the same GPU: the kubelet's answer lags the process)."""
    attribution = NodeAttribution(lambda: snap, "/nonexistent/kubelet.sock")
    found = map_node(snap, [Allocation(UUID, "nvidia.com/gpu", "vllm-0", "ns", "vllm")], {}, None)
    bare = replace(snap, gpus=(GpuSample(uuid="GPU-other", index=1),))
    attribution.allocated = found.allocated
    attribution.orphaned = map_node(bare, [], {}, None).orphaned
    assert attribution.allocated and attribution.orphaned
    return _collect(attribution.register_instruments)


def _processor_telemetry() -> Exported:
    """The processor's own metrics, as its OTLP encoding sends them downstream."""
    proc = Processor(in_process_config(forward=(Downstream("127.0.0.1:9"),)))
    try:
        req = ExportMetricsServiceRequest.FromString(self_metrics_request(proc.stats(), 0))
    finally:
        proc.stop(1)
    return _request_exported(req)


def _request_exported(req: ExportMetricsServiceRequest) -> Exported:
    return {
        m.name: (m.unit, signals.GAUGE if m.HasField("gauge") else _sum_kind(m.sum))
        for rm in req.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }


def _value(f: dataclasses.Field) -> Any:
    return {
        "uuid": UUID,
        "index": 0,
        "name": "NVIDIA H100",
        "status": "ok",
        "parent": None,
        "xid_codes": (),
        "throttle_reasons": 0x4,
        "mig_mode": False,
        "processes_listed": True,
        "read_seconds": 0.01,
    }.get(f.name, 1)


def _process_values() -> dict[str, Any]:
    return {
        "memory_rss": GIB,
        "memory_virtual": 2 * GIB,
        "cpu_utilization": 0.5,
        "thread_count": 3,
        "fd_count": 9,
    }


@pytest.fixture(scope="module")
def exported() -> Exported:
    return _everything_exported()


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(ROUTES))
def test_every_route_names_an_exported_instrument_with_its_unit_and_kind(
    name: str, exported: Exported
) -> None:
    declared = signals.BY_NAME[name]
    assert exported.get(name) == (declared.unit, declared.kind)


@pytest.mark.unit
def test_everything_exported_is_declared_once_with_its_unit_and_kind(exported: Exported) -> None:
    declared = {s.name: (s.unit, s.kind) for s in signals.SIGNALS}
    assert len(declared) == len(signals.SIGNALS)  # no name declared twice
    outputs_ = {s.name for s in signals.DETECTOR_OUTPUTS}
    assert exported == {n: v for n, v in declared.items() if n not in outputs_}


@pytest.mark.unit
@pytest.mark.parametrize("field", [*NUMERIC_FIELDS, "procs", "phase"])
def test_every_point_field_is_fed_by_a_signal(field: str) -> None:
    fed = [f for f in signals.FEEDS if f.field == field]
    assert fed, f"no signal feeds Point.{field}: the engine would never see it"
    assert all(f.signal in signals.SIGNALS for f in fed)


@pytest.mark.unit
def test_feeds_name_point_fields_and_attribute_values_the_agent_exports() -> None:
    point_fields = {f.name for f in dataclasses.fields(Point)}
    for feed in signals.FEEDS:
        assert feed.field in point_fields
        if feed.select is not None:
            key, values = feed.select
            exported_values = {
                dict(extra).get(key)
                for spec in metrics.INSTRUMENTS
                if spec.signal == feed.signal
                for _field, extra in spec.sources
            }
            assert set(values) & exported_values, f"{feed}: no exported series is selected"


# -- the agent's points and the processor's points of one snapshot ------------------------------

FULL_GPU = GpuSample(
    uuid=UUID,
    index=0,
    memory_used=30 * GIB,
    memory_total=80 * GIB,
    util_gpu=0.9,
    util_encoder=0.1,
    power_w=450.0,
    power_limit_w=700.0,
    temperature_c=66.0,
    ecc_corrected=5,
    ecc_uncorrected=2,
    xid_errors=1,
    processes_listed=True,
)
FULL = {
    "used_bytes": 30 * GIB,
    "limit_bytes": 80 * GIB,
    "util": 0.9,
    "procs": 1,
    "power_w": 450.0,
    "power_limit_w": 700.0,
    "temperature_c": 66.0,
    "ecc_uncorrected": 2,
    "xid_errors": 1,
}
SPARSE_GPU = GpuSample(uuid=UUID, index=0, memory_used=GIB, processes_listed=False)
SPARSE = {"used_bytes": GIB}  # the rest unknown (None), never 0


ON_GPU = (GpuProcessSample(pid=7, gpu_uuid=UUID, used_memory=7 * GIB),)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("gpu", "on_gpu", "gpu_point", "process_point"),
    [
        (FULL_GPU, ON_GPU, FULL, {"used_bytes": 7 * GIB, "limit_bytes": 80 * GIB}),
        # NVML could not list processes: no process subjects, the count unknown (not 0)
        (SPARSE_GPU, (), SPARSE, None),
    ],
    ids=["every-field", "unknowns"],
)
def test_agent_and_processor_read_the_same_points_from_one_snapshot(
    gpu: GpuSample, on_gpu: tuple, gpu_point: dict, process_point: dict | None
) -> None:
    """The agent judges the snapshot itself; the processor judges what the agent's instrument
    table exports of it, encoded as OTLP: the same fields, the same values."""
    snap = Snapshot(
        time=1.0,
        gpus=(gpu,),
        gpu_processes=on_gpu,
        processes=(ProcessSample(pid=7, memory_rss=3 * GIB, in_tree=True),),
    )
    agent = {s: p for s, p, _attrs in snapshot_points(snap)}
    processor = _processor_points(snap)

    def known(p: Point | None, ignore: tuple[str, ...] = ()) -> dict[str, Any] | None:
        if p is None:
            return None
        fields = (*NUMERIC_FIELDS, "procs", "phase")
        return {f: getattr(p, f) for f in fields if getattr(p, f) is not None and f not in ignore}

    assert known(agent[f"gpu:{UUID}"]) == known(processor[("gpu", UUID, None)]) == gpu_point
    process = (
        known(agent.get(f"process:7@{UUID}")),
        known(processor.get(("process_gpu", UUID, 7))),
    )
    assert process[0] == process[1] == process_point
    # host RSS: the agent adds the host's memory as the limit, the processor does not know it
    rss = known(agent["rss:7"], ("limit_bytes",)), known(processor[("process_rss", None, 7)])
    assert rss[0] == rss[1] == {"used_bytes": 3 * GIB}


def _processor_points(snap: Snapshot) -> dict[tuple[str, str | None, int | None], Point]:
    raw = encode_metrics(_agent_table(snap)).SerializeToString()
    out: dict[tuple[str, str | None, int | None], Point] = {}

    def emit(subject: Subject, point: Point) -> None:
        out[(subject.kind, subject.hw_id, subject.pid)] = point

    asm = Assembler(emit, max_series=100, grace_s=0.0, ttl_s=3600.0)
    decoder = MetricsDecoder(min_time_unix_s=0, max_future_s=3600)
    decoded = decoder.decode(raw, asm, now_ns=time.time_ns())  # the SDK stamps the wall time
    assert decoded.rejected == 0 and decoded.points > 0
    asm.flush_due(0.0, all_pending=True)
    return out


# -- detector outputs ----------------------------------------------------------------------------

OUTPUTS = {s.name: (s.unit, s.kind) for s in signals.DETECTOR_OUTPUTS}


@pytest.mark.unit
def test_the_agent_exports_exactly_the_declared_detector_outputs() -> None:
    reader = InMemoryMetricReader()
    wd = Watchdog(Engine(), Breaker(BreakerConfig()))
    wd.register_instruments(MeterProvider(metric_readers=[reader]).get_meter("t"))
    for snap in leak_snapshots(0.0, 5, lambda t: 600e6 / 3600):
        wd.on_snapshot(snap)
    assert any(a.kind == LEAK for a in wd.alerts)
    assert _exported(reader.get_metrics_data()) == OUTPUTS


ALERT = Alert(LEAK, "gpu:G", 10.0, "warning", "leaks", 1e3, 60.0, 600.0, 0.9, {"r2": 0.9})
SUBJECT = outputs.SubjectOutput((("host.name", "n1"),), (("hw.id", "G"),))


@pytest.mark.unit
def test_the_processor_exports_exactly_the_declared_detector_outputs() -> None:
    values = outputs.DetectorValues(SUBJECT, 2, 1e3, 60.0, {LEAK: 1})
    req = ExportMetricsServiceRequest.FromString(outputs.metrics_request([values], 0, 10))
    assert _request_exported(req) == OUTPUTS


def _sum_kind(s: Any) -> str:
    return signals.COUNTER if s.is_monotonic else signals.UPDOWN


CONTRACT_KEYS = {v for k, v in vars(signals).items() if k.isupper() and isinstance(v, str)} | {
    s.name for s in signals.SIGNALS
}


def _undeclared(keys: set[str]) -> set[str]:
    return {k for k in keys if k not in CONTRACT_KEYS and not k.startswith(signals.ALERT_EVIDENCE)}


@pytest.mark.unit
@pytest.mark.parametrize(
    "record_keys",
    [
        lambda: set(alert_attributes(ALERT)),
        lambda: _log_keys(alerts=[(SUBJECT, ALERT)]),
        lambda: _log_keys(
            transitions=[(SUBJECT, Transition("gpu:G", "closed", "open", 10.0, "x", ALERT, 1))]
        ),
    ],
    ids=["span-event", "alert-log", "transition-log"],
)
def test_alert_and_transition_records_use_declared_keys(
    record_keys: Callable[[], set[str]],
) -> None:
    keys = record_keys()
    assert signals.ALERT_KIND in keys
    assert _undeclared(keys) == set()


def _log_keys(alerts: list | None = None, transitions: list | None = None) -> set[str]:
    raw = outputs.logs_request(alerts or [], transitions or [], 10)
    req = ExportLogsServiceRequest.FromString(raw)
    records = [r for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records]
    assert records and {r.event_name for r in records} <= CONTRACT_KEYS
    return {a.key for r in records for a in r.attributes}


INSTRUMENT_WORDS = {"Gauge": signals.GAUGE, "Counter": signals.COUNTER}
INSTRUMENT_WORDS["UpDownCounter"] = signals.UPDOWN


def _metric_rows() -> dict[str, tuple[str, str]]:
    """Metric tables of the README and docs/: name -> (unit, kind), from rows ``| `name` | instrument |
    unit | ...`` (a row may list several names)."""
    rows: dict[str, tuple[str, str]] = {}
    for line in reference_lines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        kind = INSTRUMENT_WORDS.get(cells[1].removeprefix("Observable"))
        if kind is None:
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = (cells[2].strip("`"), kind)
    return rows


@pytest.mark.unit
@pytest.mark.parametrize("signal", signals.SIGNALS, ids=lambda s: s.name)
def test_the_docs_document_every_signal_with_its_unit_and_kind(signal: signals.Signal) -> None:
    assert _metric_rows().get(signal.name) == (signal.unit, signal.kind)


@pytest.mark.unit
def test_every_metric_row_of_the_docs_is_a_declared_signal() -> None:
    rows = _metric_rows()
    assert len(rows) >= len(signals.SIGNALS)  # the parser found the tables
    assert set(rows) - set(signals.BY_NAME) == set()


# -- the contract package: one family per module, one way to make an instrument ---------------

PACKAGE = Path(__file__).resolve().parents[1] / "otel_gpu"


@pytest.mark.unit
def test_each_public_name_of_the_contract_is_declared_in_one_module_only() -> None:
    """The package re-exports every family's names: two modules giving one name two values
    would make one of them unreachable as ``signals.NAME``."""
    modules = [*signals.FAMILIES.values(), attributes]
    seen: dict[str, object] = {}
    for module in modules:
        for name, value in vars(module).items():
            if name.isupper() and not isinstance(value, type(signals)):
                assert seen.setdefault(name, value) is value, f"{name} in {module.__name__}"
                assert getattr(signals, name) is value


@pytest.mark.unit
def test_every_signal_of_a_family_module_is_declared_there() -> None:
    found = [s for family in signals.FAMILIES for s in signals.family_signals(family)]
    assert len(found) == len(set(found)) == len(signals.SIGNALS)  # no family imports another's
    on_disk = {p.stem for p in (PACKAGE / "core" / "signals").glob("*.py")}
    assert set(signals.FAMILIES) <= on_disk
    # Every module that declares a Signal is a family (a new one must be listed in FAMILIES).
    for stem in on_disk - set(signals.FAMILIES):
        text = (PACKAGE / "core" / "signals" / f"{stem}.py").read_text()
        assert " = Signal(" not in text, f"core/signals/{stem}.py declares signals: add it"


MAKERS = re.compile(r"\.create_(observable_\w+|counter|up_down_counter|histogram|gauge)\b")


@pytest.mark.unit
def test_every_instrument_is_made_by_the_contracts_observable() -> None:
    """So each has its declared name, kind and unit, and each reader is guarded (a raising
    reader is logged once per episode, not swallowed, not once per collection)."""
    makers = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if MAKERS.search(path.read_text(encoding="utf-8"))
    }
    assert makers == {"core/signals/reading.py"}
