"""Our names against the OpenTelemetry semantic conventions' own YAML (issue 23.1).

``tests/data/semconv/v1.44.0.yaml`` is an excerpt of the conventions' model for the ``hw``,
``process``, ``cpu``, ``vcs`` and ``k8s`` groups, pinned with its source (tag and commit) and
made by ``tests/data/semconv/excerpt.py``. Every metric of ours in those namespaces must be the
convention's metric (instrument and unit), every attribute key in them that the code writes
must be the convention's (and an enum's value one of its values), and the points the agent
exports carry each required attribute and the recommended ones it can know (``hw.model``,
``hw.serial_number``, ``process.creation.time``...). The meters say which release they follow.
"""

from __future__ import annotations

import ast
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import instruments as metrics
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.instruments import creation_time, short_name
from otel_gpu.agent.settings import Settings
from otel_gpu.core import signals
from otel_gpu.sampling.sim import SimulatedSource
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PINNED = ROOT / "tests" / "data" / "semconv" / f"v{signals.SEMCONV_VERSION}.yaml"
NAMESPACES = ("hw.", "process.", "cpu.", "vcs.", "k8s.")
# Ours in a convention namespace without a convention metric, each documented in docs/metrics.md:
# the names OpenLIT's GPU collector uses for per-process GPU memory and utilization.
NOT_IN_SEMCONV = {"process.gpu.memory.usage", "process.gpu.utilization"}
# String literals in those namespaces that are no key: prefixes the demo filters names by.
NOT_KEYS = {"hw.gpu", "process.gpu"}
KIND = {signals.GAUGE: "gauge", signals.COUNTER: "counter", signals.UPDOWN: "updowncounter"}

UUID = "GPU-5e1f4c2a-9b7d-4e3f-8a1b-000000000000"
MIG = "MIG-5e1f4c2a-9b7d-4e3f-8a1b-000000000001"
CREATED = 1_764_410_000.25


@pytest.fixture(scope="module")
def convention() -> dict[str, Any]:
    text = PINNED.read_text()
    assert "commit " in text and "github.com/open-telemetry/semantic-conventions" in text
    model = yaml.safe_load(text)
    assert model["version"] == signals.SEMCONV_VERSION
    return model


def _ours() -> list[signals.Signal]:
    return [s for s in signals.SIGNALS if s.name.startswith(NAMESPACES)]


def test_each_metric_in_a_convention_namespace_is_the_conventions(convention: dict) -> None:
    checked = []
    for signal in _ours():
        if signal.name in NOT_IN_SEMCONV:
            # Still not in the conventions: when it comes, take its definition.
            assert signal.name not in convention["metrics"], signal.name
            continue
        spec = convention["metrics"].get(signal.name)
        assert spec is not None, f"{signal.name}: not a metric of semconv {signals.SEMCONV_VERSION}"
        assert (KIND[signal.kind], signal.unit) == (spec["instrument"], spec["unit"]), signal.name
        checked.append(signal.name)
    assert {"hw.gpu.utilization", "hw.temperature.limit", "process.cpu.utilization"} <= set(checked)


def _keys_in_source() -> dict[str, set[str]]:
    """Every string literal of otel_gpu/ shaped like a key in those namespaces, and where."""
    shape = re.compile(r"^(hw|process|cpu|vcs|k8s)\.[a-z0-9_.]+$")
    found: dict[str, set[str]] = {}
    for path in (ROOT / "otel_gpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and shape.match(value):
                found.setdefault(value, set()).add(str(path.relative_to(ROOT)))
    return found


def test_each_attribute_key_the_code_writes_in_those_namespaces_is_the_conventions(
    convention: dict,
) -> None:
    metric_names = set(convention["metrics"]) | {s.name for s in signals.SIGNALS}
    keys = {k: v for k, v in _keys_in_source().items() if k not in metric_names | NOT_KEYS}
    unknown = {k: sorted(v) for k, v in keys.items() if k not in convention["attributes"]}
    assert not unknown, f"not attributes of semconv {signals.SEMCONV_VERSION}: {unknown}"
    # The resource's and the series' keys are among them (the scan finds what it should).
    assert {"vcs.repository.url.full", "k8s.pod.uid", "process.creation.time", "hw.model"} <= set(
        keys
    )


def _snapshot() -> Snapshot:
    gpu = GpuSample(
        uuid=UUID, index=0, name="NVIDIA H100 80GB HBM3", memory_used=1 << 30,
        memory_total=80 << 30, util_gpu=0.5, util_encoder=0.0, util_decoder=0.0, power_w=300.0,
        energy_j=1e6, temperature_c=60.0, ecc_corrected=0, ecc_uncorrected=0, xid_errors=0,
        serial="1650923010001", firmware_version="96.00.99.00.01", driver_version="550.54.15",
        temperature_shutdown_c=92.0, temperature_slowdown_c=89.0,
    )  # fmt: skip
    mig = GpuSample(
        uuid=MIG, index=0, name="NVIDIA H100 80GB HBM3 MIG 3g.40gb", parent=UUID,
        memory_used=1 << 30, memory_total=40 << 30, serial="1650923010001",
    )  # fmt: skip
    proc = ProcessSample(
        pid=4242, parent_pid=1, executable_name="python3.11", command="python train.py --lr 3",
        command_name="python", owner="alice", create_time=CREATED, cpu_utilization=0.75,
        memory_rss=1 << 30, memory_virtual=2 << 30, thread_count=9, fd_count=20,
        start_ticks=123, cpu_system=0.25,
    )  # fmt: skip
    return Snapshot(
        time=CREATED + 60,
        gpus=(gpu, mig),
        gpu_processes=(GpuProcessSample(4242, UUID, 1 << 30, 0.5, 0.1),),
        processes=(proc,),
    )


@pytest.fixture(scope="module")
def exported() -> dict[str, list[dict[str, Any]]]:
    snap = _snapshot()
    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: snap)
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[dict[str, Any]]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(
                    {**p.attributes, "@value": p.value} for p in m.data.data_points
                )
    return out


def test_exported_points_carry_every_required_attribute(
    convention: dict, exported: dict[str, list[dict]]
) -> None:
    checked = 0
    for name, points in exported.items():
        spec = convention["metrics"].get(name)
        if spec is None:
            continue
        required = {a for a, level in spec["attributes"].items() if level == "required"}
        for p in points:
            assert required <= set(p), (name, required - set(p))
            checked += 1
    assert checked > 20 and "process.cpu.utilization" in exported


GPU_IDENTITY = {
    "hw.model": "NVIDIA H100 80GB HBM3",
    "hw.name": "GPU0",
    "hw.vendor": "NVIDIA",
    "hw.serial_number": "1650923010001",
    "hw.firmware_version": "96.00.99.00.01",
    "hw.driver_version": "550.54.15",
}


def test_gpu_series_carry_the_recommended_identity(
    convention: dict, exported: dict[str, list[dict]]
) -> None:
    for name in ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.errors", "hw.status"):
        recommended = set(convention["metrics"][name]["attributes"])
        assert set(GPU_IDENTITY) - {"hw.name"} <= recommended  # what semconv asks for
        for p in exported[name]:
            if p["hw.id"] == UUID:
                assert {k: p.get(k) for k in GPU_IDENTITY} == GPU_IDENTITY, name
    (mig,) = [p for p in exported["hw.gpu.memory.usage"] if p["hw.id"] == MIG]
    assert mig["hw.name"] == "GPU0 MIG 3g.40gb" and mig["hw.parent"] == UUID
    assert mig["hw.model"] == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"


def test_temperature_has_its_sensor_and_both_limits(
    convention: dict, exported: dict[str, list[dict]]
) -> None:
    (temp,) = exported["hw.temperature"]
    assert temp["hw.sensor_location"] == "gpu" and temp["@value"] == 60.0
    limits = {p["hw.limit_type"]: p["@value"] for p in exported["hw.temperature.limit"]}
    assert limits == {"throttled": 89.0, "high.critical": 92.0}
    assert set(limits) <= set(convention["attributes"]["hw.limit_type"]["values"])
    assert {p["hw.sensor_location"] for p in exported["hw.temperature.limit"]} == {"gpu"}


def test_process_series_name_the_command_and_creation_time(
    exported: dict[str, list[dict]],
) -> None:
    (rss,) = exported["process.memory.usage"]
    assert rss["process.command"] == "python"  # argv[0]
    assert rss["process.command_line"] == "python train.py --lr 3"
    assert rss["process.creation.time"] == "2025-11-29T09:53:20.250Z"
    assert datetime.fromisoformat(rss["process.creation.time"]).timestamp() == CREATED
    cpu = {p["cpu.mode"]: p["@value"] for p in exported["process.cpu.utilization"]}
    assert cpu == {"user": 0.5, "system": 0.25}  # the sum is the process's total, 0.75


def test_enum_values_we_write_are_the_conventions(
    convention: dict, exported: dict[str, list[dict]]
) -> None:
    attrs = convention["attributes"]
    for key in ("hw.type", "hw.state", "hw.gpu.task", "hw.limit_type", "cpu.mode"):
        values = {p[key] for points in exported.values() for p in points if key in p}
        assert values and values <= set(attrs[key]["values"]), (key, values)


def test_short_names_and_creation_times() -> None:
    assert short_name(3, "NVIDIA A100-SXM4-80GB", None) == "GPU3"
    assert short_name(1, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", UUID) == "GPU1 MIG 1g.10gb"
    assert short_name(1, None, UUID) == "GPU1 MIG"
    assert creation_time(None) is None
    assert creation_time(0.0) == "1970-01-01T00:00:00.000Z"


def test_the_agents_meter_names_its_schema() -> None:
    reader = InMemoryMetricReader()
    settings = Settings.load(env={}, simulate="steady", detect=False, sampler="thread")
    Agent(settings, meter_provider=MeterProvider([reader]), source=SimulatedSource("steady"))
    data = reader.get_metrics_data()
    assert data is not None
    scopes = {sm.scope.name: sm.scope.schema_url for rm in data.resource_metrics for sm in
              rm.scope_metrics}  # fmt: skip
    assert scopes["otel_gpu"] == f"https://opentelemetry.io/schemas/{signals.SEMCONV_VERSION}"
