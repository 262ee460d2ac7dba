"""The instrument table: every metric the agent exports, registered in one loop.

Each row pairs a signal of the contract (``otel_gpu.core.signals``: name, kind, unit, description)
with the reader of its observations and, for readers that copy sample fields, those fields,
which the agent's detection points read too (``otel_gpu.agent.points``).

Callbacks read the sampler's latest snapshot only (no NVML, no /proc), skip unknown values and
return nothing in a forked child (a DataLoader worker must not export the parent's series).
Series that end (an exited process, a removed GPU) are forgotten by the SDK, and a counter that
goes backwards starts a new series (otel_gpu/agent/series.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.agent.labels import NO_LABELS, SeriesLabels, collecting
from otel_gpu.agent.series import SeriesBook
from otel_gpu.core import signals as sig
from otel_gpu.core.signals import COUNTER, Signal, observable
from otel_gpu.sampling.snapshot import (
    STATUS_DEGRADED,
    STATUS_FAILED,
    STATUS_OK,
    GpuSample,
    ProcessSample,
    Snapshot,
)

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


Extra = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Instrument:
    """A contract signal and the reader of its observations from a snapshot.

    ``sources``: for readers that copy sample fields, each (sample field, extra point attributes)
    pair, one per series of a sample: what the agent's detection points read (points.py).
    """

    signal: Signal
    read: Reader
    sources: tuple[tuple[str, Extra], ...] = ()

    @property
    def name(self) -> str:
        return self.signal.name

    @property
    def kind(self) -> str:
        return self.signal.kind

    @property
    def unit(self) -> str:
        return self.signal.unit


def gpu_attrs(g: GpuSample, extra: Extra = ()) -> Attrs:
    """A GPU's point attributes plus ``extra`` and the collection's labels of the GPU
    (otel_gpu/agent/labels.py). Shared, cached dicts: callers must not mutate."""
    labels = collecting.get().gpu.get(g.uuid, ())
    identity = (g.serial, g.firmware_version, g.driver_version)
    return _gpu_attrs(g.uuid, g.index, g.name, g.parent, identity, extra, labels)


def short_name(index: int, model: str | None, parent: str | None) -> str:
    """``hw.name``: ``GPU<index>`` as nvidia-smi numbers it; a MIG device adds its profile,
    ``GPU0 MIG 3g.40gb`` (from NVML's name, ``... MIG 3g.40gb``)."""
    if parent is None:
        return f"GPU{index}"
    profile = model.rsplit(" MIG ", 1)[1] if model and " MIG " in model else ""
    return f"GPU{index} MIG {profile}".rstrip()


# Attribute dicts are built once per series, not once per point per collection: building them
# was a quarter of the agent's collection cost (benchmarks/bench_sample_cycle.py).
@functools.lru_cache(maxsize=4096)
def _gpu_attrs(
    uuid: str,
    index: int,
    model: str | None,
    parent: str | None,
    identity: tuple[str | None, str | None, str | None],
    extra: Extra,
    labels: Extra,
) -> Attrs:
    attrs: Attrs = {
        sig.HW_ID: uuid,
        sig.HW_TYPE: "gpu",
        sig.HW_VENDOR: "NVIDIA",
        sig.HW_NAME: short_name(index, model, parent),
        sig.GPU_INDEX: index,
    }
    serial, firmware, driver = identity
    for key, value in (
        (sig.HW_MODEL, model),
        (sig.HW_PARENT, parent),
        (sig.HW_SERIAL_NUMBER, serial),
        (sig.HW_FIRMWARE_VERSION, firmware),
        (sig.HW_DRIVER_VERSION, driver),
    ):
        if value:
            attrs[key] = value
    attrs.update(labels)
    attrs.update(extra)
    return attrs


def _gpu_series(signal: Signal, *series: tuple[str, Attrs]) -> Instrument:
    """A signal copied from GpuSample fields: one series per (field, extra attributes)."""
    sources = tuple((field, tuple(extra.items())) for field, extra in series)

    def read(snap: Snapshot) -> Iterator[Observation]:
        for g in snap.gpus:
            for field, extra in sources:
                value = getattr(g, field)
                if value is not None:
                    yield Observation(value, gpu_attrs(g, extra))

    return Instrument(signal, read, sources)


def _memory_utilization(snap: Snapshot) -> Iterator[Observation]:
    for g in snap.gpus:
        if g.memory_used is not None and g.memory_total:
            yield Observation(g.memory_used / g.memory_total, gpu_attrs(g))


def _status(snap: Snapshot) -> Iterator[Observation]:
    for g in snap.gpus:
        for state in (STATUS_OK, STATUS_DEGRADED, STATUS_FAILED):
            value = 1.0 if g.status == state else 0.0
            yield Observation(value, gpu_attrs(g, ((sig.HW_STATE, state),)))


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
                    yield Observation(active, gpu_attrs(g, ((sig.THROTTLE_REASON, reason),)))

    return read


def process_attrs(p: ProcessSample, hw_id: str | None = None) -> Attrs:
    """A process's point attributes (plus ``hw.id`` and the collection's labels of the
    process, otel_gpu/agent/labels.py). Shared, cached dicts: do not mutate."""
    labels = collecting.get().process.get((p.pid, p.start_ticks), ())
    return _process_attrs(
        p.pid, p.vpid, p.parent_pid, p.executable_name, p.command_name, p.command, p.owner,
        p.create_time, hw_id, labels,
    )  # fmt: skip


def creation_time(created: float | None) -> str | None:
    """``process.creation.time``: ISO 8601 in UTC with milliseconds, e.g.
    ``2023-11-21T09:25:34.850Z`` (the kernel counts a start in clock ticks, 10 ms)."""
    if created is None:
        return None
    stamp = datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


@functools.lru_cache(maxsize=16384)
def _process_attrs(
    pid: int,
    vpid: int | None,
    parent_pid: int | None,
    exe: str | None,
    command: str | None,
    command_line: str | None,
    owner: str | None,
    created: float | None,
    hw_id: str | None,
    labels: Extra,
) -> Attrs:
    attrs: Attrs = {sig.PROCESS_PID: pid}
    for key, value in (
        (sig.PROCESS_VPID, vpid),
        (sig.PROCESS_PARENT_PID, parent_pid),
        (sig.PROCESS_EXECUTABLE, exe),
        (sig.PROCESS_COMMAND, command),
        (sig.PROCESS_COMMAND_LINE, command_line),
        (sig.PROCESS_OWNER, owner),
        (sig.PROCESS_CREATION_TIME, creation_time(created)),
        (sig.HW_ID, hw_id),
    ):
        if value is not None:
            attrs[key] = value
    attrs.update(labels)
    return attrs


class _ProcessView:
    """A snapshot's processes paired with their attribute dicts, built once per snapshot and
    shared by the seven process instruments (one cache lookup per process, not seven)."""

    __slots__ = ("snap", "labels", "procs", "gpu_procs", "_cpu")

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
        self._cpu: list[Observation] | None = None

    def cpu(self) -> list[Observation]:
        """``process.cpu.utilization`` by ``cpu.mode`` (user, system), built once per snapshot."""
        if self._cpu is None:
            out = []
            for p, attrs in self.procs:
                total = p.cpu_utilization
                if total is None:
                    continue
                system = p.cpu_system or 0.0
                out.append(Observation(total - system, {**attrs, sig.CPU_MODE: "user"}))
                out.append(Observation(system, {**attrs, sig.CPU_MODE: "system"}))
            self._cpu = out
        return self._cpu


_view: _ProcessView | None = None


def _process_view(snap: Snapshot) -> _ProcessView:
    global _view
    view = _view
    labels = collecting.get()
    if view is None or view.snap is not snap or view.labels is not labels:
        view = _view = _ProcessView(snap, labels)  # a racing collection builds an equal one
    return view


def _per_process(signal: Signal, field: str, *, on_gpu: bool = False) -> Instrument:
    """A signal copied from a ProcessSample field, or with ``on_gpu`` from a GpuProcessSample
    field (one process on one GPU)."""

    def read(snap: Snapshot) -> Iterator[Observation]:
        view = _process_view(snap)
        for sample, attrs in view.gpu_procs if on_gpu else view.procs:
            value = getattr(sample, field)
            if value is not None:
                yield Observation(value, attrs)

    return Instrument(signal, read, ((field, ()),))


_NO_ATTRS: Attrs = {}


def _processes_dropped(snap: Snapshot) -> Iterator[Observation]:
    yield Observation(float(snap.processes_dropped), _NO_ATTRS)


INSTRUMENTS: tuple[Instrument, ...] = (
    _gpu_series(
        sig.GPU_UTILIZATION,
        ("util_gpu", {sig.GPU_TASK: "general"}),
        ("util_encoder", {sig.GPU_TASK: "encoder"}),
        ("util_decoder", {sig.GPU_TASK: "decoder"}),
    ),
    _gpu_series(sig.GPU_MEMORY_USAGE, ("memory_used", {})),
    _gpu_series(sig.GPU_MEMORY_LIMIT, ("memory_total", {})),
    Instrument(sig.GPU_MEMORY_UTILIZATION, _memory_utilization),
    _gpu_series(sig.GPU_MEMORY_RESERVED, ("memory_reserved", {})),
    _gpu_series(sig.GPU_MEMORY_CONTROLLER, ("util_memory", {})),
    _gpu_series(sig.GPU_POWER, ("power_w", {})),
    _gpu_series(sig.GPU_POWER_LIMIT, ("power_limit_w", {})),
    _gpu_series(sig.GPU_ENERGY, ("energy_j", {})),
    _gpu_series(sig.GPU_TEMPERATURE, ("temperature_c", {sig.HW_SENSOR_LOCATION: "gpu"})),
    _gpu_series(
        sig.GPU_TEMPERATURE_LIMIT,
        ("temperature_slowdown_c", {sig.HW_SENSOR_LOCATION: "gpu", sig.HW_LIMIT_TYPE: "throttled"}),
        (
            "temperature_shutdown_c",
            {sig.HW_SENSOR_LOCATION: "gpu", sig.HW_LIMIT_TYPE: "high.critical"},
        ),
    ),
    _gpu_series(
        sig.GPU_ERRORS,
        ("ecc_corrected", {sig.ERROR_TYPE: "corrected"}),
        ("ecc_uncorrected", {sig.ERROR_TYPE: "uncorrected"}),
        ("xid_errors", {sig.ERROR_TYPE: "xid"}),
    ),
    Instrument(sig.GPU_STATUS, _status),
    _gpu_series(sig.GPU_XID_LAST, ("xid_last", {})),
    _gpu_series(
        sig.GPU_XID,
        ("xid_application", {sig.XID_CLASS: "application"}),
        ("xid_reset", {sig.XID_CLASS: "reset"}),
        ("xid_severe", {sig.XID_CLASS: "severe"}),
    ),
    _gpu_series(
        sig.GPU_CLOCK,
        ("clock_sm_hz", {sig.CLOCK_DOMAIN: "sm"}),
        ("clock_mem_hz", {sig.CLOCK_DOMAIN: "memory"}),
    ),
    _gpu_series(
        sig.GPU_PCIE,
        ("pcie_tx_bytes_per_s", {sig.IO_DIRECTION: "transmit"}),
        ("pcie_rx_bytes_per_s", {sig.IO_DIRECTION: "receive"}),
    ),
    Instrument(sig.GPU_THROTTLE, _throttle_reader()),
    _per_process(sig.PROCESS_GPU_MEMORY, "used_memory", on_gpu=True),
    _per_process(sig.PROCESS_GPU_UTILIZATION, "sm_util", on_gpu=True),
    Instrument(sig.PROCESS_CPU_UTILIZATION, lambda snap: _process_view(snap).cpu()),
    _per_process(sig.PROCESS_MEMORY, "memory_rss"),
    _per_process(sig.PROCESS_MEMORY_VIRTUAL, "memory_virtual"),
    _per_process(sig.PROCESS_THREADS, "thread_count"),
    _per_process(sig.PROCESS_FDS, "fd_count"),
    Instrument(sig.PROCESSES_DROPPED, _processes_dropped),
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
        try:  # a reader that raises loses this instrument's points, logged once per episode
            observations = list(spec.read(snap))  # (otel_gpu.core.signals.reading)
        finally:
            collecting.reset(token)
        book.observe(observations)
        return observations

    book.instrument = observable(meter, spec.signal, [callback])
    return book.instrument
