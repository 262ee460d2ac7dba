"""The instrument table: every metric the agent exports, declared once and registered in one loop.

Callbacks read the sampler's latest snapshot only (no NVML, no /proc), skip unknown values and
return nothing in a forked child (a DataLoader worker must not export the parent's series).
Series that end (an exited process, a removed GPU) are forgotten by the SDK, and a counter that
goes backwards starts a new series (otel_gpu/series.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.labels import NO_LABELS, SeriesLabels, collecting
from otel_gpu.sampling.snapshot import (
    STATUS_DEGRADED,
    STATUS_FAILED,
    STATUS_OK,
    GpuSample,
    ProcessSample,
    Snapshot,
)
from otel_gpu.series import SeriesBook

GAUGE = "gauge"
COUNTER = "counter"
UPDOWN = "updowncounter"

Attrs = dict[str, Any]
Reader = Callable[[Snapshot], Iterable[Observation]]

# NVML clocks-event (throttle) reason bits -> names (nvml.h nvmlClocksEventReason*).
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass(frozen=True)
class Instrument:
    name: str
    kind: str
    unit: str
    description: str
    read: Reader


Extra = tuple[tuple[str, Any], ...]


def gpu_attrs(g: GpuSample, extra: Extra = ()) -> Attrs:
    """A GPU's point attributes plus ``extra`` and the collection's labels of the GPU
    (otel_gpu/labels.py). Shared, cached dicts: callers must not mutate."""
    labels = collecting.get().gpu.get(g.uuid, ())
    return _gpu_attrs(g.uuid, g.index, g.name, g.parent, extra, labels)


# Attribute dicts are built once per series, not once per point per collection: building them
# was a quarter of the agent's collection cost (benchmarks/bench_sample_cycle.py).
@functools.lru_cache(maxsize=4096)
def _gpu_attrs(
    uuid: str, index: int, name: str | None, parent: str | None, extra: Extra, labels: Extra
) -> Attrs:
    attrs: Attrs = {"hw.id": uuid, "hw.type": "gpu", "hw.vendor": "NVIDIA", "gpu.index": index}
    if name:
        attrs["hw.name"] = name
    if parent:
        attrs["hw.parent"] = parent
    attrs.update(labels)
    attrs.update(extra)
    return attrs


def _per_gpu(field: str, scale: float = 1.0) -> Reader:
    def read(snap: Snapshot) -> Iterator[Observation]:
        for g in snap.gpus:
            value = getattr(g, field)
            if value is not None:
                yield Observation(value * scale, gpu_attrs(g))

    return read


def _gpu_multi(pairs: Iterable[tuple[str, Attrs]]) -> Reader:
    fields = tuple((field, tuple(extra.items())) for field, extra in pairs)

    def read(snap: Snapshot) -> Iterator[Observation]:
        for g in snap.gpus:
            for field, extra in fields:
                value = getattr(g, field)
                if value is not None:
                    yield Observation(value, gpu_attrs(g, extra))

    return read


def _memory_utilization(snap: Snapshot) -> Iterator[Observation]:
    for g in snap.gpus:
        if g.memory_used is not None and g.memory_total:
            yield Observation(g.memory_used / g.memory_total, gpu_attrs(g))


def _status(snap: Snapshot) -> Iterator[Observation]:
    for g in snap.gpus:
        for state in (STATUS_OK, STATUS_DEGRADED, STATUS_FAILED):
            value = 1.0 if g.status == state else 0.0
            yield Observation(value, gpu_attrs(g, (("hw.state", state),)))


def _throttle_reader() -> Reader:
    """1 while a reason is active, 0 once it has cleared. Reasons a GPU never reported are left
    out: nine always-zero series per GPU would cost collection time and say nothing."""
    ever: dict[str, int] = {}  # GPU UUID -> every reason bit seen so far

    def read(snap: Snapshot) -> Iterator[Observation]:
        for g in snap.gpus:
            if g.throttle_reasons is None:
                continue
            seen = ever[g.uuid] = ever.get(g.uuid, 0) | g.throttle_reasons
            for bit, reason in THROTTLE_REASONS.items():
                if seen & bit:
                    active = 1.0 if g.throttle_reasons & bit else 0.0
                    yield Observation(active, gpu_attrs(g, (("otel_gpu.throttle.reason", reason),)))

    return read


def process_attrs(p: ProcessSample, hw_id: str | None = None) -> Attrs:
    """A process's point attributes (plus ``hw.id`` and the collection's labels of the
    process, otel_gpu/labels.py). Shared, cached dicts: do not mutate."""
    labels = collecting.get().process.get(p.pid, ())
    return _process_attrs(
        p.pid, p.vpid, p.parent_pid, p.executable_name, p.command, p.owner, hw_id, labels
    )


@functools.lru_cache(maxsize=16384)
def _process_attrs(
    pid: int,
    vpid: int | None,
    parent_pid: int | None,
    exe: str | None,
    command: str | None,
    owner: str | None,
    hw_id: str | None,
    labels: Extra,
) -> Attrs:
    attrs: Attrs = {"process.pid": pid}
    for key, value in (
        ("process.vpid", vpid),
        ("process.parent_pid", parent_pid),
        ("process.executable.name", exe),
        ("process.command", command),
        ("process.owner", owner),
        ("hw.id", hw_id),
    ):
        if value is not None:
            attrs[key] = value
    attrs.update(labels)
    return attrs


class _ProcessView:
    """A snapshot's processes paired with their attribute dicts, built once per snapshot and
    shared by the seven process instruments (one cache lookup per process, not seven)."""

    __slots__ = ("snap", "labels", "procs", "gpu_procs")

    def __init__(self, snap: Snapshot, labels: SeriesLabels) -> None:
        self.snap = snap
        self.labels = labels
        self.procs = [(p, process_attrs(p)) for p in snap.processes]
        by_pid = {p.pid: p for p in snap.processes}
        gpu_procs = []
        for gp in snap.gpu_processes:
            # NVML reports host PIDs; unmapped ones are still reported under the host PID.
            proc = by_pid.get(snap.host_to_local.get(gp.pid, gp.pid)) or ProcessSample(pid=gp.pid)
            gpu_procs.append((gp, process_attrs(proc, gp.gpu_uuid)))
        self.gpu_procs = gpu_procs


_view: _ProcessView | None = None


def _process_view(snap: Snapshot) -> _ProcessView:
    global _view
    view = _view
    labels = collecting.get()
    if view is None or view.snap is not snap or view.labels is not labels:
        view = _view = _ProcessView(snap, labels)  # a racing collection builds an equal one
    return view


def _per_process(field: str) -> Reader:
    def read(snap: Snapshot) -> Iterator[Observation]:
        for p, attrs in _process_view(snap).procs:
            value = getattr(p, field)
            if value is not None:
                yield Observation(value, attrs)

    return read


def _process_gpu(field: str) -> Reader:
    def read(snap: Snapshot) -> Iterator[Observation]:
        for gp, attrs in _process_view(snap).gpu_procs:
            value = getattr(gp, field)
            if value is not None:
                yield Observation(value, attrs)

    return read


_NO_ATTRS: Attrs = {}


def _agent(snap: Snapshot) -> Iterator[Observation]:
    yield Observation(float(snap.processes_dropped), _NO_ATTRS)


INSTRUMENTS: tuple[Instrument, ...] = (
    Instrument(
        "hw.gpu.utilization",
        GAUGE,
        "1",
        "Fraction of time the GPU ran work, by task (general = any kernel, encoder, decoder)",
        _gpu_multi(
            (
                ("util_gpu", {"hw.gpu.task": "general"}),
                ("util_encoder", {"hw.gpu.task": "encoder"}),
                ("util_decoder", {"hw.gpu.task": "decoder"}),
            )
        ),
    ),
    Instrument("hw.gpu.memory.usage", UPDOWN, "By", "GPU memory in use", _per_gpu("memory_used")),
    Instrument(
        "hw.gpu.memory.limit", UPDOWN, "By", "GPU memory in total", _per_gpu("memory_total")
    ),
    Instrument(
        "hw.gpu.memory.utilization",
        GAUGE,
        "1",
        "Fraction of GPU memory in use (usage / limit)",
        _memory_utilization,
    ),
    Instrument(
        "otel_gpu.gpu.memory.reserved",
        UPDOWN,
        "By",
        "GPU memory reserved by the driver (included in usage)",
        _per_gpu("memory_reserved"),
    ),
    Instrument(
        "otel_gpu.gpu.memory_controller.utilization",
        GAUGE,
        "1",
        "Fraction of time device memory was read or written (NVML 'memory' utilization)",
        _per_gpu("util_memory"),
    ),
    Instrument("hw.power", GAUGE, "W", "GPU power draw", _per_gpu("power_w")),
    Instrument(
        "otel_gpu.gpu.power.limit",
        GAUGE,
        "W",
        "Enforced GPU power limit",
        _per_gpu("power_limit_w"),
    ),
    Instrument(
        "hw.energy", COUNTER, "J", "GPU energy since the driver loaded", _per_gpu("energy_j")
    ),
    Instrument("hw.temperature", GAUGE, "Cel", "GPU core temperature", _per_gpu("temperature_c")),
    Instrument(
        "hw.errors",
        COUNTER,
        "{error}",
        "GPU errors: ECC corrected and uncorrected (volatile), Xid events seen by the agent",
        _gpu_multi(
            (
                ("ecc_corrected", {"error.type": "corrected"}),
                ("ecc_uncorrected", {"error.type": "uncorrected"}),
                ("xid_errors", {"error.type": "xid"}),
            )
        ),
    ),
    Instrument("hw.status", UPDOWN, "1", "GPU status: 1 for the current hw.state", _status),
    Instrument(
        "otel_gpu.gpu.xid.last",
        GAUGE,
        "{code}",
        "Code of the last Xid event seen on the GPU, reported beside hw.status once the GPU is "
        "lost (79: fallen off the bus)",
        _per_gpu("xid_last"),
    ),
    Instrument(
        "otel_gpu.gpu.clock.frequency",
        GAUGE,
        "Hz",
        "GPU clock frequencies by domain",
        _gpu_multi(
            (
                ("clock_sm_hz", {"otel_gpu.clock.domain": "sm"}),
                ("clock_mem_hz", {"otel_gpu.clock.domain": "memory"}),
            )
        ),
    ),
    Instrument(
        "otel_gpu.gpu.pcie.throughput",
        GAUGE,
        "By/s",
        "PCIe throughput by direction",
        _gpu_multi(
            (
                ("pcie_tx_bytes_per_s", {"network.io.direction": "transmit"}),
                ("pcie_rx_bytes_per_s", {"network.io.direction": "receive"}),
            )
        ),
    ),
    Instrument(
        "otel_gpu.gpu.throttle",
        GAUGE,
        "1",
        "1 while a clocks-event (throttle) reason is active, 0 after it cleared",
        _throttle_reader(),
    ),
    Instrument(
        "process.gpu.memory.usage",
        UPDOWN,
        "By",
        "GPU memory used by a process on one GPU",
        _process_gpu("used_memory"),
    ),
    Instrument(
        "process.gpu.utilization",
        GAUGE,
        "1",
        "Fraction of time a process ran kernels on one GPU (NVML samples)",
        _process_gpu("sm_util"),
    ),
    Instrument(
        "process.cpu.utilization",
        GAUGE,
        "1",
        "CPU time / elapsed time / CPUs available",
        _per_process("cpu_utilization"),
    ),
    Instrument("process.memory.usage", UPDOWN, "By", "Resident memory", _per_process("memory_rss")),
    Instrument(
        "process.memory.virtual", UPDOWN, "By", "Virtual memory", _per_process("memory_virtual")
    ),
    Instrument("process.thread.count", UPDOWN, "{thread}", "Threads", _per_process("thread_count")),
    Instrument(
        "process.unix.file_descriptor.count",
        UPDOWN,
        "{file_descriptor}",
        "Open file descriptors",
        _per_process("fd_count"),
    ),
    Instrument(
        "otel_gpu.agent.processes.dropped",
        GAUGE,
        "{process}",
        "Processes not tracked in the last sweep because of OTEL_GPU_MAX_PROCESSES",
        _agent,
    ),
)


_pid = os.getpid()  # this process's PID, kept current across forks without a syscall per call


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def register(
    meter: Meter,
    latest: Callable[[], Snapshot | None],
    instruments: Iterable[Instrument] = INSTRUMENTS,
    labels: Callable[[], SeriesLabels] | None = None,
) -> list[Any]:
    """Create one observable instrument per table row, all reading ``latest()``; ``labels()``
    gives the extra attributes of GPUs and processes (e.g. ``k8s.*``), looked up per series."""
    owner = os.getpid()
    created = []
    for spec in instruments:
        created.append(_create(meter, spec, latest, owner, labels or _no_labels))
    return created


def _no_labels() -> SeriesLabels:
    return NO_LABELS


def _create(
    meter: Meter,
    spec: Instrument,
    latest: Callable[[], Snapshot | None],
    owner: int,
    labels: Callable[[], SeriesLabels],
) -> Any:
    book = SeriesBook(spec.name, monotonic=spec.kind == COUNTER)

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        if _pid != owner:  # forked child (DataLoader worker): the parent reports
            return []
        snap = latest()
        if snap is None:
            return []
        token = collecting.set(labels())
        try:
            observations = list(spec.read(snap))
        except Exception:  # a reader bug loses this instrument's points, never the cycle
            return []
        finally:
            collecting.reset(token)
        book.observe(observations)
        return observations

    make = {
        GAUGE: meter.create_observable_gauge,
        COUNTER: meter.create_observable_counter,
        UPDOWN: meter.create_observable_up_down_counter,
    }[spec.kind]
    book.instrument = make(
        spec.name, callbacks=[callback], unit=spec.unit, description=spec.description
    )
    return book.instrument
