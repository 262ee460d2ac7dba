"""NVML's process lists: which entry point the loaded driver has, and the entry layout it fills.

The agent reads the compute, graphics and MPS lists itself (NVML's two-call protocol through
ctypes) rather than through pynvml, which builds a Python object per process and whose struct
size has differed from the driver's (nvidia-ml-py 12.535.77 read 32-byte entries where every
later driver fills 24). What each driver branch's ``nvml.h`` declares (docs/sampling.md,
"Driver branches"):

* ``_v2`` lists, on every supported driver (r470 on): 24-byte ``nvmlProcessInfo_v2_t``;
* ``_v3`` lists, 510.39.01 on (not 535.98): ``nvmlProcessInfo_t``, 24 bytes, except in
  535.43.02-535.86.x where it gained ``usedGpuCcProtectedMemory`` without a version bump
  (32 bytes). Those releases are told apart as nvitop does: they export
  ``nvmlDeviceGetConfComputeMemSizeInfo`` but not yet ``nvmlDeviceGetRunningProcessDetailList``
  (535.104.05, which went back to 24 bytes).

Lists of two or more entries are also checked, until one passes (per library and entry point):
under the wrong layout every entry past the first is garbage (a PID of 0 or past Linux's limit,
instance ids that are neither "none" nor a MIG id, or MIG and non-MIG entries in one list). A
list that fails under the chosen layout but not under the other switches that library to the
other; entries that fail under both are left out. Each is logged once per library.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any

import pynvml

from otel_gpu.sampling.nvml_api import newest_function

log = logging.getLogger("otel_gpu.nvml")

ENTRY_24 = struct.Struct("=I4xQII")  # nvmlProcessInfo_v2_t: pid, usedGpuMemory, gi, ci
ENTRY_32 = struct.Struct("=I4xQII8x")  # + usedGpuCcProtectedMemory (535.43.02-535.86.x _v3)
PROCESS_INFO = ENTRY_24  # what current drivers fill
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE for usedGpuMemory
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG mode
MAX_INSTANCE_ID = 64  # MIG GPU / compute instance ids are small (at most 7 instances a GPU)
PID_MAX_LIMIT = 1 << 22  # Linux's highest possible PID (kernel PID_MAX_LIMIT, 64-bit)

# Process lists: (metric, NVML symbols newest first, pynvml's own function for old pynvml
# versions).
COMPUTE = (
    "processes",
    ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "ComputeRunningProcesses",
)
GRAPHICS = (
    "graphics_processes",
    ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
    "GraphicsRunningProcesses",
)
MPS = (
    "mps_processes",
    ("nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v2"),
    "MPSComputeRunningProcesses",
)
ProcessList = tuple[str, tuple[str, ...], str]

# The layout chosen per loaded library: {id(library): layout} for the _v3 lists (the _v2 ones
# are 24 bytes everywhere); the library object is kept to tell a reloaded one apart.
_v3_layout: dict[int, tuple[Any, struct.Struct]] = {}
# Lists whose layout a list of two or more entries has borne out, {(id(library), symbol):
# library}: not checked again (a layout is the library's, and checking costs as much as reading)
_confirmed: dict[tuple[int, str], Any] = {}
_logged: set[tuple[int, str]] = set()


def _exports(symbol: str) -> bool:
    try:
        pynvml._nvmlGetFunctionPointer(symbol)
    except pynvml.NVMLError as err:
        if err.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return False
    return True


def v3_layout() -> struct.Struct:
    """The entry the loaded library's ``_v3`` lists fill, from the symbols it exports."""
    lib = pynvml.nvmlLib
    known = _v3_layout.get(id(lib))
    if known is not None and known[0] is lib:
        return known[1]
    cc_entries = _exports("nvmlDeviceGetConfComputeMemSizeInfo") and not _exports(
        "nvmlDeviceGetRunningProcessDetailList"
    )
    layout = ENTRY_32 if cc_entries else ENTRY_24
    _v3_layout[id(lib)] = (lib, layout)
    if cc_entries:
        log.info("NVML: a 535.43-535.86 driver, its _v3 process lists read as 32-byte entries")
    return layout


def _plausible(entry: tuple[int, int, int, int]) -> bool:
    pid, _used, gi, ci = entry
    return (
        0 < pid <= PID_MAX_LIMIT
        and (gi == NO_INSTANCE or gi < MAX_INSTANCE_ID)
        and (ci == NO_INSTANCE or ci < MAX_INSTANCE_ID)
    )


def _plausible_list(entries: list[tuple[int, int, int, int]]) -> bool:
    """Every entry plausible, and all of them in MIG mode or none (a GPU is one or the other)."""
    return all(map(_plausible, entries)) and len({e[2] == NO_INSTANCE for e in entries}) <= 1


def _once(what: str, message: str, *args: Any) -> None:
    key = (id(pynvml.nvmlLib), what)
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


def decode(
    raw: bytes, count: int, layout: struct.Struct, symbol: str
) -> list[tuple[int, int, int, int]]:
    """``count`` entries of ``raw`` in ``layout``, checked (see the module's docstring); a
    ``_v3`` layout found wrong is switched for this library, garbled entries left out."""
    lib = pynvml.nvmlLib
    entries = list(layout.iter_unpack(raw[: layout.size * count]))
    if count < 2:
        return entries  # one entry reads the same in either layout
    if _plausible_list(entries):
        _confirmed[(id(lib), symbol)] = lib
        return entries
    other = ENTRY_32 if layout is ENTRY_24 else ENTRY_24
    retry = list(other.iter_unpack(raw[: other.size * count]))
    if symbol.endswith("_v3") and _plausible_list(retry):  # _v2 entries: 24 bytes in every nvml.h
        _v3_layout[id(lib)] = (lib, other)
        _confirmed[(id(lib), symbol)] = lib
        _once(
            "layout",
            "NVML %s: entries read as %d bytes are garbled, as %d bytes they are not; "
            "reading %d-byte entries from now on",
            symbol,
            layout.size,
            other.size,
            other.size,
        )
        return retry
    kept = [e for e in entries if _plausible(e)]
    if len(kept) == count:  # only MIG and non-MIG entries mixed: nothing to tell garbage by
        return entries
    _once(
        "garbled",
        "NVML %s: %d of %d process entries garbled (a PID of 0 or past the limit, or an "
        "instance id that is neither none nor a MIG id): left out",
        symbol,
        count - len(kept),
        count,
    )
    return kept


def running_processes(handle: Any, which: ProcessList = COMPUTE) -> list[tuple[int, int | None]]:
    """(pid, used GPU bytes or None) of the processes on a device in one of NVML's lists:
    compute, graphics, or MPS clients (under MPS the compute list shows only the MPS server),
    through the ``_v3`` function or, on a driver without it, the ``_v2`` one.

    Done here rather than by pynvml's ``nvmlDeviceGetComputeRunningProcesses`` because that
    builds a Python object per process: for 8 GPUs x 64 processes it was 70 % of a sweep (and,
    on a driver without ``_v3``, it raises ``NVMLLibraryMismatchError``).
    """
    get_function = getattr(pynvml, "_nvmlGetFunctionPointer", None)
    if get_function is None:  # a pynvml without it: its own (slower) implementation
        listed = getattr(pynvml, f"nvmlDeviceGet{which[2]}")(handle)
        return [(p.pid, p.usedGpuMemory) for p in listed]
    fn = newest_function(which[1])
    symbol = fn.__name__
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    count.value = count.value * 2 + 5  # room for processes that start between the two calls
    # room for the largest entry any driver fills, whichever layout it turns out to be
    entries = ctypes.create_string_buffer(ENTRY_32.size * count.value)
    ret = fn(handle, ctypes.byref(count), entries)
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    n = count.value
    layout = v3_layout() if symbol.endswith("_v3") else ENTRY_24
    if _confirmed.get((id(pynvml.nvmlLib), symbol)) is pynvml.nvmlLib:
        read: Any = layout.iter_unpack(ctypes.string_at(entries, layout.size * n))
    else:
        read = decode(entries.raw, n, layout, symbol)
    return [(pid, None if used == NOT_AVAILABLE else used) for pid, used, _gi, _ci in read]
