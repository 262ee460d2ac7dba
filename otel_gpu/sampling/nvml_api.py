"""What NvmlSource asks NVML, and how NVML's answers are classified and converted.

Tables of per-device metrics (pynvml function, arguments, unit conversion), the error classes
that decide what a failure means, and the few calls done with ctypes directly for speed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from otel_gpu.sampling import odd_values as odd
from otel_gpu.sampling.snapshot import GpuProcessSample

FAILED: Any = object()  # "no value": NVML's own functions may return None on success
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
MAX_EVENTS_PER_SWEEP = 256

ERROR_NAMES = {
    getattr(pynvml, n): n[len("NVML_ERROR_") :] for n in dir(pynvml) if n.startswith("NVML_ERROR_")
}
UNSUPPORTED = {
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
    getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25),
}
DEVICE_LOST = {
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED,
    getattr(pynvml, "NVML_ERROR_GPU_NOT_FOUND", 28),
}
NO_LIBRARY = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
}
NO_GPU_REASONS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "NVML library libnvidia-ml.so.1 not found "
    "(no NVIDIA driver installed, or set OTEL_GPU_NVML_LIBRARY)",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "NVIDIA driver not loaded",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to use NVML (check access to /dev/nvidia*)",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "NVML library and kernel driver versions differ "
    "(reload the driver or reboot)",
}


def function(*names: str) -> Callable[..., Any] | None:
    """The first pynvml function of ``names`` this pynvml version has (None: metric off)."""
    return next((getattr(pynvml, n) for n in names if hasattr(pynvml, n)), None)


# The function each list of alternative symbols resolved to, per loaded library.
_resolved: dict[tuple[str, ...], tuple[Any, Any]] = {}


def newest_function(symbols: tuple[str, ...]) -> Any:
    """The first of ``symbols`` (newest first) the loaded library has, as a ctypes function;
    looked up once per library (a missing symbol costs pynvml a lock and a failed lookup on
    every ask). None of them: FUNCTION_NOT_FOUND, so the metric is not asked again."""
    lib = pynvml.nvmlLib
    known = _resolved.get(symbols)
    if known is not None and known[0] is lib:
        return known[1]
    for symbol in symbols:
        try:
            fn = pynvml._nvmlGetFunctionPointer(symbol)
        except pynvml.NVMLError as err:
            if err.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            continue
        _resolved[symbols] = (lib, fn)
        return fn
    raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


# Older drivers know only the "throttle" name; newer ones keep it, deprecated.
CLOCKS_EVENT_REASONS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)


def clocks_event_reasons(handle: Any) -> int:
    """The device's clocks-event (throttle) reasons bitmask, under either name."""
    reasons = ctypes.c_ulonglong()
    ret = newest_function(CLOCKS_EVENT_REASONS)(handle, ctypes.byref(reasons))
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    return reasons.value


def _milli(v: Any) -> float:
    return v / 1000.0


def _mhz(v: Any) -> float:
    return v * 1e6


def _kib(v: Any) -> float:
    return v * 1024.0  # NVML reports PCIe throughput in KB/s with 1 KiB granularity


# Simple per-device metrics: (metric, GpuSample field, pynvml function, extra args, converter).
SCALARS: tuple[tuple[str, str, Callable[..., Any] | None, tuple[int, ...], Callable], ...] = (
    ("power", "power_w", function("nvmlDeviceGetPowerUsage"), (), _milli),
    ("power_limit", "power_limit_w", function("nvmlDeviceGetEnforcedPowerLimit"), (), _milli),
    ("energy", "energy_j", function("nvmlDeviceGetTotalEnergyConsumption"), (), _milli),
    (
        "encoder",
        "util_encoder",
        function("nvmlDeviceGetEncoderUtilization"),
        (),
        lambda v: odd.fraction(v[0]),
    ),
    (
        "decoder",
        "util_decoder",
        function("nvmlDeviceGetDecoderUtilization"),
        (),
        lambda v: odd.fraction(v[0]),
    ),
    ("clock_sm", "clock_sm_hz", function("nvmlDeviceGetClockInfo"), (1,), _mhz),
    ("clock_mem", "clock_mem_hz", function("nvmlDeviceGetClockInfo"), (2,), _mhz),
    ("pcie_tx", "pcie_tx_bytes_per_s", function("nvmlDeviceGetPcieThroughput"), (0,), _kib),
    ("pcie_rx", "pcie_rx_bytes_per_s", function("nvmlDeviceGetPcieThroughput"), (1,), _kib),
    # (memory error type, counter type): corrected/uncorrected, volatile (since driver load)
    ("ecc_corrected", "ecc_corrected", function("nvmlDeviceGetTotalEccErrors"), (0, 0), int),
    ("ecc_uncorrected", "ecc_uncorrected", function("nvmlDeviceGetTotalEccErrors"), (1, 0), int),
    ("throttle", "throttle_reasons", clocks_event_reasons, (), int),
    ("mig", "mig_mode", function("nvmlDeviceGetMigMode"), (), lambda v: bool(v[0])),
)
# Metrics that change rarely or are costly to read, re-read every SLOW_PERIOD_S and reported
# from the last read in between (as DCGM updates fields at per-field rates): the power limit
# changes only when an administrator sets it, ECC counts and the MIG mode almost never, and
# nvmlDeviceGetPcieThroughput blocks ~20 ms per call on real GPUs (it measures over a 20 ms
# window). Xid events, which report uncorrectable memory errors at once, are polled every sweep.
# The video engines (IDLE_ENGINES) idle through training and LLM serving: while idle they are
# read with the slow metrics, once busy every sweep until idle again.
IDLE_ENGINES = frozenset({"encoder", "decoder"})
SLOW = frozenset(
    {"power_limit", "ecc_corrected", "ecc_uncorrected", "pcie_tx", "pcie_rx", "mig"} | IDLE_ENGINES
)
SLOW_PERIOD_S = 10.0
# Alternatives, newest first: (metric, pynvml function, extra args); the first supported wins.
Alternatives = tuple[tuple[str, Callable[..., Any] | None, tuple[Any, ...]], ...]
MEMORY: Alternatives = (
    ("memory_v2", pynvml.nvmlDeviceGetMemoryInfo, (getattr(pynvml, "nvmlMemory_v2", None),)),
    ("memory", pynvml.nvmlDeviceGetMemoryInfo, ()),
)
TEMPERATURE: Alternatives = (
    ("temperature_v", function("nvmlDeviceGetTemperatureV"), (0,)),  # NVML_TEMPERATURE_GPU
    ("temperature", function("nvmlDeviceGetTemperature"), (0,)),
)


DEVICE_STRING_SIZE = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE, NVML_DEVICE_UUID_V2_BUFFER_SIZE


def device_string(symbol: str, handle: Any) -> bytes:
    """A device's name or UUID (``nvmlDeviceGetName`` / ``nvmlDeviceGetUUID``) as NVML's bytes.

    pynvml decodes these as UTF-8 and raises on anything else, which would lose the device
    (UUID) or its name; :mod:`odd_values` decides what to make of the bytes instead.
    """
    get_function = getattr(pynvml, "_nvmlGetFunctionPointer", None)
    if get_function is None:  # a pynvml without it: its own function
        value = getattr(pynvml, symbol)(handle)
        return value if isinstance(value, bytes) else str(value).encode()
    buf = ctypes.create_string_buffer(DEVICE_STRING_SIZE)
    ret = get_function(symbol)(handle, buf, ctypes.c_uint(DEVICE_STRING_SIZE))
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    return buf.value


def text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def bind_library(path: str) -> None:
    """Make pynvml use the libnvidia-ml at ``path`` (pynvml otherwise loads it by name)."""
    lib = ctypes.CDLL(path)
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        if current is None or getattr(current, "_handle", None) != lib._handle:
            pynvml.nvmlLib = lib
            pynvml._nvmlGetFunctionPointer_cache.clear()


class LibraryGone(Exception):
    """NVML as a whole is unusable (no driver, uninitialized): back to "no GPU" mode."""

    def __init__(self, code: int):
        self.code = code


class DeviceFailed(Exception):
    """The device is lost; skip its remaining calls this sweep."""


# What NVML answers for a MIG device: its memory and its processes. Everything else (engine
# utilization, power, temperature, clocks, ...) is per physical GPU or not available in MIG mode.
MIG_UNSUPPORTED = frozenset(
    {"utilization", "temperature_v", "temperature", "process_util", *(m[0] for m in SCALARS)}
)
MIG_MAX = 7  # MIG devices per GPU at most


@dataclass
class Device:
    """One selected GPU (or MIG device) and what NvmlSource remembers about it between sweeps."""

    index: int  # NVML index (PCI bus order); a MIG device's is its parent's
    handle: Any
    uuid: str
    name: str | None
    address: int | None  # handle pointer value, to map events to devices
    parent: str | None = None  # a MIG device's parent GPU UUID
    mig_enabled: bool | None = None  # a GPU's MIG mode when its MIG devices were enumerated
    key: int = -1  # unique among devices: the NVML index (the default), or for a MIG device
    # a number past every GPU index
    disabled: set[str] = field(default_factory=set)
    lost: bool = False
    probing: bool = False  # a lost device being read again to see whether it is back
    probe_at: float = 0.0
    xid_count: int | None = None  # None: Xid events not available on this device
    xid_last: int | None = None  # the code of the last Xid seen (None: none yet)
    # Xid events by class of the catalog (otel_gpu/core/xid.py), counted with xid_count
    xid_classes: dict[str, int] = field(default_factory=dict)
    util_seen_us: int = 0  # newest process-utilization sample timestamp seen (NVML µs)
    util_last: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    util_at: float = 0.0  # time.monotonic() when util_last was read
    slow_at: float = float("-inf")  # when the SLOW metrics are due again (NvmlSource clock)
    slow_values: dict[str, Any] = field(default_factory=dict)  # their last values
    # Graphics / MPS process lists seen non-empty and video engines seen busy: read every sweep
    # until empty or idle again (otherwise with the slow metrics: most GPUs that train have
    # none of them).
    active_lists: set[str] = field(default_factory=set)
    # Read once when the device is first selected (nvml_devices.read_identity): None where
    # NVML has no answer (consumer boards have no serial number).
    identity_read: bool = False
    serial: str | None = None  # hw.serial_number
    vbios: str | None = None  # hw.firmware_version
    temperature_shutdown_c: float | None = None  # hw.temperature.limit, high.critical
    temperature_slowdown_c: float | None = None  # hw.temperature.limit, throttled

    def __post_init__(self) -> None:
        if self.key == -1:
            self.key = self.index


@dataclass
class Sweep:
    """What one sweep gathered; the caller may read it while an abandoned sweep still runs."""

    fields: dict[int, dict[str, Any]] = field(default_factory=dict)
    processes: list[GpuProcessSample] = field(default_factory=list)
    library_error: int | None = None
