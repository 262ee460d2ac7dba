"""The immutable records that one sampler sweep produces.

Every field that NVML or /proc could not provide is ``None`` ("unknown"); readers skip it and
never report it as 0. Units are converted here, at the edge: bytes, watts, joules, degrees
Celsius, hertz, fractions 0..1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# hw.status states (semconv hw.state values we use).
STATUS_OK = "ok"
STATUS_DEGRADED = "degraded"
STATUS_FAILED = "failed"


# The per-process records, built by the dozen each sweep, are named tuples of plain values:
# immutable, as cheap to build as a slotted class (a frozen dataclass costs 4x), and untracked
# by the garbage collector once it has seen them, so the records a sweep keeps alive for one
# interval do not make the collector's full passes more frequent or longer in the process the
# agent runs in. GpuSample (one per GPU) is a slotted dataclass: its ``index`` field would
# shadow ``tuple.index``.


@dataclass(slots=True)
class GpuSample:
    """One GPU at one sweep. ``uuid`` is the stable series key (``hw.id``)."""

    uuid: str  # GPU-... or, for a MIG device, MIG-...
    index: int  # NVML index (a MIG device's parent's)
    name: str | None = None
    status: str = STATUS_OK
    parent: str | None = None  # a MIG device's parent GPU UUID (hw.parent)
    memory_used: int | None = None  # By (NVML "used"; includes driver-reserved memory)
    memory_total: int | None = None  # By
    memory_reserved: int | None = None  # By (memory info v2 only)
    util_gpu: float | None = None  # 0..1, fraction of time a kernel ran
    util_memory: float | None = None  # 0..1, fraction of time memory was read/written
    util_encoder: float | None = None  # 0..1
    util_decoder: float | None = None  # 0..1
    power_w: float | None = None
    power_limit_w: float | None = None
    energy_j: float | None = None  # cumulative since driver load
    temperature_c: float | None = None
    ecc_corrected: int | None = None  # cumulative (volatile) count
    ecc_uncorrected: int | None = None
    xid_errors: int | None = None  # Xid events seen since the agent started
    xid_codes: tuple[int, ...] = ()  # the Xid codes that arrived during this sweep
    # Xid events since the agent started by class (otel_gpu/core/xid.py), NVML's and the
    # kernel log's together, each event counted once.
    xid_application: int | None = None
    xid_reset: int | None = None
    xid_severe: int | None = None
    # The code of the last Xid seen on this GPU, in any sweep; still reported once the GPU is
    # lost, as the reason why (Xid 79: fallen off the bus).
    xid_last: int | None = None
    clock_sm_hz: float | None = None
    clock_mem_hz: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    throttle_reasons: int | None = None  # NVML clocks-event-reasons bitmask
    mig_mode: bool | None = None
    # Whether NVML's process list was read this sweep (False: not supported or the call failed,
    # so an empty list says nothing about how many processes hold the GPU).
    processes_listed: bool | None = None
    # Wall time (s) this sweep spent reading this device: the slow GPU in a slow sweep.
    read_seconds: float | None = None
    # Read once per device (hw.serial_number, hw.firmware_version = VBIOS, hw.driver_version)
    serial: str | None = None
    firmware_version: str | None = None
    driver_version: str | None = None
    temperature_shutdown_c: float | None = None  # hw.temperature.limit (high.critical)
    temperature_slowdown_c: float | None = None  # hw.temperature.limit (throttled)


class GpuProcessSample(NamedTuple):
    """One process as NVML lists it on one GPU (host PID namespace)."""

    pid: int  # host PID as NVML reports it
    gpu_uuid: str
    used_memory: int | None = None  # By; None when NVML says "not available"
    sm_util: float | None = None  # 0..1 from process utilization samples
    mem_util: float | None = None  # 0..1


class ProcessSample(NamedTuple):
    """One OS process of the watched tree (or a GPU process NVML lists), from /proc."""

    pid: int  # PID in the agent's /proc (the host PID when the agent sees the host's PIDs)
    vpid: int | None = None  # PID inside the process's own namespace (last NSpid) when it differs
    parent_pid: int | None = None
    executable_name: str | None = None
    command: str | None = None  # the command line as OTEL_GPU_PROCESS_COMMAND asks (truncated)
    owner: str | None = None
    create_time: float | None = None  # s since epoch; guards PID reuse
    cpu_utilization: float | None = None  # 0..1: CPU time / elapsed / CPUs available (semconv)
    memory_rss: int | None = None  # By
    memory_virtual: int | None = None  # By
    thread_count: int | None = None
    fd_count: int | None = None
    in_tree: bool = True  # False: not in the watched tree, only seen on the job's GPUs
    start_ticks: int | None = None  # /proc/PID/stat starttime (clock ticks after boot): exact
    cpu_system: float | None = None  # the kernel-mode share of cpu_utilization (cpu.mode=system)
    command_name: str | None = None  # argv[0], credentials masked (process.command)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one sweep saw. Published atomically by the sampler; readers never mutate it."""

    time: float  # wall clock (s since epoch) at the end of the sweep
    gpus: tuple[GpuSample, ...] = ()
    gpu_processes: tuple[GpuProcessSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    processes_dropped: int = 0  # processes not tracked because of the cap (this sweep)
    unmapped_gpu_pids: tuple[int, ...] = ()  # NVML PIDs that map to no visible process
    host_to_local: dict[int, int] = field(default_factory=dict)  # NVML (host) PID -> agent PID
    no_gpu_reason: str | None = None  # set while NVML is unavailable
    sweep_seconds: float | None = None  # how long the sweep took
    # NVML errors by name (e.g. ("TIMEOUT", 3)) since the sampling process started.
    nvml_errors: tuple[tuple[str, int], ...] = ()
    # Effective seconds between reads of each kind (otel_gpu/sampling/budget.py), e.g.
    # (("gpu", 1.0), ("process_details", 4.0)); empty when the sampler does not adapt.
    intervals: tuple[tuple[str, float], ...] = ()
