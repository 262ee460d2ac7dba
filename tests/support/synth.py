"""Agent-shaped OTLP metrics requests with explicit timestamps, for tests and benchmarks.

The names, kinds and attribute keys come from the signal contract (``otel_gpu.core.signals``): per GPU
~15 device series keyed by ``hw.id``, per process 7 series keyed by ``process.pid`` (GPU ones
also by ``hw.id``). Values come from a caller's function (called with the metric's name) so a test can make one
series leak.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_gpu.core import signals as sig

GIB = 1024**3

# (signal, extra point attributes): one series per GPU each
DEVICE_SERIES: tuple[tuple[sig.Signal, dict[str, str]], ...] = (
    (sig.GPU_UTILIZATION, {sig.GPU_TASK: "general"}),
    (sig.GPU_UTILIZATION, {sig.GPU_TASK: "encoder"}),
    (sig.GPU_UTILIZATION, {sig.GPU_TASK: "decoder"}),
    (sig.GPU_MEMORY_USAGE, {}),
    (sig.GPU_MEMORY_LIMIT, {}),
    (sig.GPU_MEMORY_UTILIZATION, {}),
    (sig.GPU_POWER, {}),
    (sig.GPU_POWER_LIMIT, {}),
    (sig.GPU_ENERGY, {}),
    (sig.GPU_TEMPERATURE, {}),
    (sig.GPU_ERRORS, {sig.ERROR_TYPE: "corrected"}),
    (sig.GPU_ERRORS, {sig.ERROR_TYPE: "uncorrected"}),
    (sig.GPU_ERRORS, {sig.ERROR_TYPE: "xid"}),
    (sig.GPU_CLOCK, {sig.CLOCK_DOMAIN: "sm"}),
    (sig.GPU_MEMORY_CONTROLLER, {}),
)
# one series per process each (the GPU ones also keyed by hw.id)
PROCESS_SERIES: tuple[sig.Signal, ...] = (
    sig.PROCESS_GPU_MEMORY,
    sig.PROCESS_GPU_UTILIZATION,
    sig.PROCESS_CPU_UTILIZATION,
    sig.PROCESS_MEMORY,
    sig.PROCESS_MEMORY_VIRTUAL,
    sig.PROCESS_THREADS,
    sig.PROCESS_FDS,
)
_ON_GPU = (sig.PROCESS_GPU_MEMORY, sig.PROCESS_GPU_UTILIZATION)

# value(metric, index, extra attributes) -> value; index is the GPU or process index.
ValueFn = Callable[[str, int, dict[str, str]], float | None]


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-5e1f-4c2a-9b7d-{index:012x}"


_HEALTHY: dict[str, float] = {
    sig.GPU_MEMORY_USAGE.name: 60 * GIB,
    sig.GPU_MEMORY_LIMIT.name: 80 * GIB,
    sig.GPU_MEMORY_UTILIZATION.name: 0.75,
    sig.GPU_POWER.name: 610.0,
    sig.GPU_POWER_LIMIT.name: 700.0,
    sig.GPU_ENERGY.name: 1.0e7,
    sig.GPU_TEMPERATURE.name: 71.0,
    sig.GPU_ERRORS.name: 0.0,
    sig.GPU_CLOCK.name: 1.98e9,
    sig.GPU_MEMORY_CONTROLLER.name: 0.4,
    sig.PROCESS_GPU_MEMORY.name: 7 * GIB,
    sig.PROCESS_GPU_UTILIZATION.name: 0.9,
    sig.PROCESS_CPU_UTILIZATION.name: 0.3,
    sig.PROCESS_MEMORY.name: 3 * GIB,
    sig.PROCESS_MEMORY_VIRTUAL.name: 40 * GIB,
    sig.PROCESS_THREADS.name: 24,
    sig.PROCESS_FDS.name: 180,
}


def default_value(metric: str, index: int, extra: dict[str, str]) -> float | None:
    """A healthy, busy training node."""
    if metric == sig.GPU_UTILIZATION.name:
        return 0.93 if extra.get(sig.GPU_TASK) == "general" else 0.0
    return _HEALTHY.get(metric)


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
        (sig.PROCESS_PID, 4242),
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

    def data(signal: sig.Signal):  # type: ignore[no-untyped-def]
        m = metrics.get(signal.name)
        if m is None:
            m = metrics[signal.name] = sm.metrics.add(name=signal.name)
        if signal.kind == sig.GAUGE:
            return m.gauge  # type: ignore[attr-defined]
        s = m.sum  # type: ignore[attr-defined]
        s.aggregation_temporality = 2
        s.is_monotonic = signal.kind == sig.COUNTER
        return s

    for signal, extra in DEVICE_SERIES:
        d = data(signal)
        for g in range(gpus):
            v = value(signal.name, g, extra)
            if v is None:
                continue
            dp = d.data_points.add(time_unix_nano=time_ns, start_time_unix_nano=start)
            dp.as_double = float(v)
            gpu_attrs: list[tuple[str, str | int]] = [
                (sig.HW_ID, gpu_uuid(g)),
                (sig.HW_TYPE, "gpu"),
                (sig.HW_VENDOR, "NVIDIA"),
                (sig.GPU_INDEX, g),
                (sig.HW_NAME, f"GPU{g}"),
                (sig.HW_MODEL, "NVIDIA H100 80GB HBM3"),
                *extra.items(),
            ]
            for k, a in gpu_attrs:
                dp.attributes.append(_kv(k, a))
    for signal in PROCESS_SERIES:
        d = data(signal)
        for p in range(processes):
            v = value(signal.name, p, {})
            if v is None:
                continue
            dp = d.data_points.add(time_unix_nano=time_ns, start_time_unix_nano=start)
            if signal.kind == sig.GAUGE:
                dp.as_double = float(v)
            else:
                dp.as_int = int(v)
            attrs: list[tuple[str, str | int]] = [
                (sig.PROCESS_PID, 10_000 + p),
                (sig.PROCESS_PARENT_PID, 4242),
                (sig.PROCESS_EXECUTABLE, "python3"),
                (sig.PROCESS_COMMAND, "python3 train.py --config sft.yaml"),
            ]
            if signal in _ON_GPU:
                attrs.append((sig.HW_ID, gpu_uuid(p % max(gpus, 1))))
            for k, a in attrs:
                dp.attributes.append(_kv(k, a))
    return req


def trainer_request(
    time_ns: int,
    *,
    rank: int,
    work_s: float,
    job: str = "job-1",
    host: str = "node-1",
    gpu: str | None = None,
) -> ExportMetricsServiceRequest:
    """One export of one rank of a torchrun job: its resource (``otel_gpu.job.id``,
    ``otel_gpu.job.rank``, its own instance id and PID) with ``training.step.work``, and torch's
    allocator on its GPU when ``gpu`` is given (how the processor learns a rank's GPU)."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    resource: tuple[tuple[str, str | int], ...] = (
        ("service.name", "train"),
        ("service.instance.id", f"{job}-rank-{rank}"),
        ("host.name", host),
        (sig.PROCESS_PID, 5000 + rank),
        ("otel_gpu.job.id", job),
        ("otel_gpu.job.rank", rank),
    )
    for k, r in resource:
        rm.resource.attributes.append(_kv(k, r))
    sm = rm.scope_metrics.add()
    sm.scope.name = "otel_gpu.tracing"
    work = sm.metrics.add(name=sig.TRAINING_STEP_WORK.name)
    work.gauge.data_points.add(time_unix_nano=time_ns, as_double=work_s)
    if gpu is not None:
        torch = sm.metrics.add(name=sig.TORCH_ALLOCATED.name).sum
        torch.aggregation_temporality = 2
        dp = torch.data_points.add(time_unix_nano=time_ns, start_time_unix_nano=time_ns - 10**9)
        dp.as_int = 5 * GIB
        dp.attributes.extend([_kv(sig.GPU_INDEX, rank), _kv(sig.HW_ID, gpu)])
    return req


def add_gpu_facts(
    req: ExportMetricsServiceRequest,
    time_ns: int,
    gpu: str,
    *,
    throttled: tuple[str, ...] = (),
    cleared: tuple[str, ...] = (),
    pcie_bytes_per_s: tuple[float, float] | None = None,
) -> None:
    """The agent's throttle reasons (1 active, 0 cleared) and PCIe throughput (receive,
    transmit) of one GPU, added to an :func:`agent_request`."""
    sm = req.resource_metrics[0].scope_metrics[0]
    rows = [(sig.GPU_THROTTLE, sig.THROTTLE_REASON, r, 1.0) for r in throttled]
    rows += [(sig.GPU_THROTTLE, sig.THROTTLE_REASON, r, 0.0) for r in cleared]
    if pcie_bytes_per_s is not None:
        rx, tx = pcie_bytes_per_s
        rows += [(sig.GPU_PCIE, sig.IO_DIRECTION, "receive", rx)]
        rows += [(sig.GPU_PCIE, sig.IO_DIRECTION, "transmit", tx)]
    for signal, key, value, v in rows:
        found = [m for m in sm.metrics if m.name == signal.name]
        m = found[0] if found else sm.metrics.add(name=signal.name)
        dp = m.gauge.data_points.add(time_unix_nano=time_ns, as_double=v)
        dp.attributes.extend([_kv(sig.HW_ID, gpu), _kv(key, value)])
