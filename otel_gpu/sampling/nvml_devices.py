"""Device enumeration: which GPUs and MIG devices NVML has, and under which UUIDs.

Run by :class:`~otel_gpu.sampling.nvml.NvmlSource` on its NVML thread: at initialization,
after a MIG reconfiguration and when the GPU count changes (hot-plug). ``call(metric, fn,
*args)`` is its guarded NVML entry point for calls without a device: the value, or
``nvml_api.FAILED``. A device whose UUID cannot be a series key (``odd_values.uuid``) or
repeats one already taken is not watched: its points would have no key, or mix with another's.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import pynvml

from otel_gpu.sampling import nvml_api as api
from otel_gpu.sampling import odd_values as odd
from otel_gpu.sampling.nvml_api import Device

log = logging.getLogger("otel_gpu.nvml")

Call = Callable[..., Any]


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value  # maps events to devices


def _name(call: Call, metric: str, handle: Any) -> str | None:
    name = call(metric, api.device_string, "nvmlDeviceGetName", handle)
    return None if name is api.FAILED else odd.name(name)


# nvmlTemperatureThresholds_t (nvml.h, every driver branch since r470 and before)
THRESHOLD_SHUTDOWN = 0
THRESHOLD_SLOWDOWN = 1


def read_identity(call: Call, dev: Device, parent: Device | None = None) -> None:
    """What never changes while a device is there, read once: serial number, VBIOS version
    and the temperature thresholds. A MIG device has its GPU's (``parent``); NVML answers
    none of them for a MIG handle. ``call`` gives ``api.FAILED`` for an error (unknown)."""
    dev.identity_read = True
    if parent is not None:
        dev.serial, dev.vbios = parent.serial, parent.vbios
        return
    for attr, symbol in (("serial", "nvmlDeviceGetSerial"), ("vbios", "nvmlDeviceGetVbiosVersion")):
        value = call(f"identity_{attr}", api.device_string, symbol, dev.handle)
        setattr(dev, attr, None if value is api.FAILED else odd.name(value))
    for attr, kind in (
        ("temperature_shutdown_c", THRESHOLD_SHUTDOWN),
        ("temperature_slowdown_c", THRESHOLD_SLOWDOWN),
    ):
        value = call(
            "identity_threshold", pynvml.nvmlDeviceGetTemperatureThreshold, dev.handle, kind
        )
        setattr(dev, attr, None if value is api.FAILED else odd.temperature(value))


def enumerate_gpus(call: Call, count: int) -> list[Device | None]:
    """The GPUs at NVML indexes 0..count-1; None where one is not watched."""
    found: list[Device | None] = []
    seen: dict[str, int] = {}
    for i in range(count):
        handle = call("handle", pynvml.nvmlDeviceGetHandleByIndex, i)
        uuid = (
            api.FAILED
            if handle is api.FAILED
            else call("uuid", api.device_string, "nvmlDeviceGetUUID", handle)
        )
        key = None if uuid is api.FAILED else odd.uuid(uuid)
        if key is None or key in seen:
            why = "cannot be identified" if uuid is api.FAILED else f"reports UUID {uuid!r}"
            if key is not None:
                why += f", as GPU {seen[key]} does"
            log.warning("GPU %d %s; not watched", i, why)
            found.append(None)
            continue
        seen[key] = i
        found.append(Device(i, handle, key, _name(call, "name", handle), _address(handle)))
    return found


def enumerate_mig(call: Call, gpu: Device, taken: set[str]) -> list[Device]:
    """The MIG devices of a GPU in MIG mode (none otherwise); ``taken``: the UUIDs already
    used, updated. In MIG mode NVML reports memory and processes per MIG device, and the GPU's
    own process list is their aggregate: it is not read, so no process is counted twice."""
    mode = call("mig_mode", pynvml.nvmlDeviceGetMigMode, gpu.handle)
    gpu.mig_enabled = None if mode is api.FAILED else bool(mode[0])
    if not gpu.mig_enabled:
        return []
    most = call("mig_count", pynvml.nvmlDeviceGetMaxMigDeviceCount, gpu.handle)
    found: list[Device] = []
    for i in range(0 if most is api.FAILED else min(most, api.MIG_MAX)):
        handle = call("mig_handle", pynvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, i)
        if handle is api.FAILED:
            continue  # no MIG device in this slot
        uuid = call("mig_uuid", api.device_string, "nvmlDeviceGetUUID", handle)
        key = None if uuid is api.FAILED else odd.uuid(uuid)
        if key is None or key in taken:
            if uuid is not api.FAILED:
                log.warning("GPU %d: a MIG device reports UUID %r; not watched", gpu.index, uuid)
            continue
        taken.add(key)
        found.append(
            Device(
                gpu.index,
                handle,
                key,
                _name(call, "mig_name", handle),
                _address(handle),
                parent=gpu.uuid,
                key=(gpu.index + 1) * 1000 + i,
                disabled=set(api.MIG_UNSUPPORTED),
            )
        )
    if found:
        gpu.disabled.add("processes")
        log.info(
            "GPU %s (%s) is in MIG mode: %d MIG device(s), reported under their own UUIDs",
            gpu.index,
            gpu.uuid,
            len(found),
        )
    return found
