"""Agent-shaped OTLP metrics requests with explicit timestamps, for tests and benchmarks.

The names and attributes follow ``otel_gpu.metrics`` (the agent's instrument table): per GPU
~15 device series keyed by ``hw.id``, per process 7 series keyed by ``process.pid`` (GPU ones
also by ``hw.id``). Values come from a caller's function so a test can make one series leak.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

GIB = 1024**3

# (metric, "gauge" | "updown" | "counter", extra point attributes)
DEVICE_SERIES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("hw.gpu.utilization", "gauge", {"hw.gpu.task": "general"}),
    ("hw.gpu.utilization", "gauge", {"hw.gpu.task": "encoder"}),
    ("hw.gpu.utilization", "gauge", {"hw.gpu.task": "decoder"}),
    ("hw.gpu.memory.usage", "updown", {}),
    ("hw.gpu.memory.limit", "updown", {}),
    ("hw.gpu.memory.utilization", "gauge", {}),
    ("hw.power", "gauge", {}),
    ("otel_gpu.gpu.power.limit", "gauge", {}),
    ("hw.energy", "counter", {}),
    ("hw.temperature", "gauge", {}),
    ("hw.errors", "counter", {"error.type": "corrected"}),
    ("hw.errors", "counter", {"error.type": "uncorrected"}),
    ("hw.errors", "counter", {"error.type": "xid"}),
    ("otel_gpu.gpu.clock.frequency", "gauge", {"otel_gpu.clock.domain": "sm"}),
    ("otel_gpu.gpu.memory_controller.utilization", "gauge", {}),
)
PROCESS_SERIES: tuple[tuple[str, str], ...] = (
    ("process.gpu.memory.usage", "updown"),
    ("process.gpu.utilization", "gauge"),
    ("process.cpu.utilization", "gauge"),
    ("process.memory.usage", "updown"),
    ("process.memory.virtual", "updown"),
    ("process.thread.count", "updown"),
    ("process.unix.file_descriptor.count", "updown"),
)

# value(metric, index, extra attributes) -> value; index is the GPU or process index.
ValueFn = Callable[[str, int, dict[str, str]], float | None]


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-5e1f-4c2a-9b7d-{index:012x}"


def default_value(metric: str, index: int, extra: dict[str, str]) -> float | None:
    """A healthy, busy training node."""
    return {
        "hw.gpu.utilization": 0.93 if extra.get("hw.gpu.task") == "general" else 0.0,
        "hw.gpu.memory.usage": 60 * GIB,
        "hw.gpu.memory.limit": 80 * GIB,
        "hw.gpu.memory.utilization": 0.75,
        "hw.power": 610.0,
        "otel_gpu.gpu.power.limit": 700.0,
        "hw.energy": 1.0e7,
        "hw.temperature": 71.0,
        "hw.errors": 0.0,
        "otel_gpu.gpu.clock.frequency": 1.98e9,
        "otel_gpu.gpu.memory_controller.utilization": 0.4,
        "process.gpu.memory.usage": 7 * GIB,
        "process.gpu.utilization": 0.9,
        "process.cpu.utilization": 0.3,
        "process.memory.usage": 3 * GIB,
        "process.memory.virtual": 40 * GIB,
        "process.thread.count": 24,
        "process.unix.file_descriptor.count": 180,
    }.get(metric)


def _kv(key: str, value: str | int) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def agent_request(
    time_ns: int,
    *,
    gpus: int = 8,
    processes: int = 64,
    host: str = "node-1",
    instance: str = "run-1",
    value: ValueFn = default_value,
    start_ns: int | None = None,
) -> ExportMetricsServiceRequest:
    """One collection of one agent, shaped as the OTel SDK encodes it (one scope)."""
    start = time_ns - 10**12 if start_ns is None else start_ns
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    resource: tuple[tuple[str, str | int], ...] = (
        ("service.name", "trainer"),
        ("service.instance.id", instance),
        ("host.name", host),
        ("process.pid", 4242),
        ("telemetry.sdk.language", "python"),
        ("telemetry.sdk.name", "opentelemetry"),
        ("telemetry.sdk.version", "1.45.2"),
        ("vcs.ref.head.revision", "0f3c2a9e4b5d6e7f8091a2b3c4d5e6f708192a3b"),
    )
    for k, r in resource:
        rm.resource.attributes.append(_kv(k, r))
    sm = rm.scope_metrics.add()
    sm.scope.name = "otel_gpu"
    metrics: dict[str, object] = {}

    def data(name: str, kind: str):  # type: ignore[no-untyped-def]
        m = metrics.get(name)
        if m is None:
            m = metrics[name] = sm.metrics.add(name=name)
        if kind == "gauge":
            return m.gauge  # type: ignore[attr-defined]
        s = m.sum  # type: ignore[attr-defined]
        s.aggregation_temporality = 2
        s.is_monotonic = kind == "counter"
        return s

    for name, kind, extra in DEVICE_SERIES:
        d = data(name, kind)
        for g in range(gpus):
            v = value(name, g, extra)
            if v is None:
                continue
            dp = d.data_points.add(time_unix_nano=time_ns, start_time_unix_nano=start)
            dp.as_double = float(v)
            gpu_attrs: list[tuple[str, str | int]] = [
                ("hw.id", gpu_uuid(g)),
                ("hw.type", "gpu"),
                ("hw.vendor", "NVIDIA"),
                ("gpu.index", g),
                ("hw.name", "NVIDIA H100 80GB HBM3"),
                *extra.items(),
            ]
            for k, a in gpu_attrs:
                dp.attributes.append(_kv(k, a))
    for name, kind in PROCESS_SERIES:
        d = data(name, kind)
        for p in range(processes):
            v = value(name, p, {})
            if v is None:
                continue
            dp = d.data_points.add(time_unix_nano=time_ns, start_time_unix_nano=start)
            if kind == "gauge":
                dp.as_double = float(v)
            else:
                dp.as_int = int(v)
            attrs: list[tuple[str, str | int]] = [
                ("process.pid", 10_000 + p),
                ("process.parent_pid", 4242),
                ("process.executable.name", "python3"),
                ("process.command", "python3 train.py --config sft.yaml"),
            ]
            if name.startswith("process.gpu."):
                attrs.append(("hw.id", gpu_uuid(p % max(gpus, 1))))
            for k, a in attrs:
                dp.attributes.append(_kv(k, a))
    return req
