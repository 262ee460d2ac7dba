"""Real GPUs through NVML (pynvml), as a :class:`~otel_gpu.sampling.source.DeviceSource`.

Every NVML call goes through :meth:`NvmlSource._call` on one dedicated thread
(:class:`~otel_gpu.sampling.nvml_guard.CallGuard`), so a hung call never stalls the sampler for
more than ``sweep_timeout_s``. Failures are classified once, here:

* NOT_SUPPORTED (and FUNCTION_NOT_FOUND, NO_PERMISSION, version mismatches): that metric is
  never asked again on that device;
* GPU_IS_LOST (RESET_REQUIRED, GPU_NOT_FOUND): the device is reported ``failed`` and skipped,
  probed again every ``lost_retry_s``; the other devices keep flowing;
* library or driver missing (LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, UNINITIALIZED, a library and
  driver version mismatch): "no GPU" mode, :class:`DeviceReading` carries the reason, and NVML
  is initialized again with exponential backoff (1 s doubling to ``retry_max_s``);
* anything else (TIMEOUT, UNKNOWN, ...): the value is unknown (None) for this sweep.

Each error is logged once per episode (device, metric, error); a success ends the episode.
Units are converted here: bytes, W (from mW), J (from mJ), Cel, Hz (from MHz), B/s (from KiB/s)
and fractions 0..1 (from %); readings that cannot be right are skipped or clamped by the rules
of :mod:`~otel_gpu.sampling.odd_values` (each logged once per device and metric).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pynvml

from otel_gpu.core.xid import CLASSES, XidDedup, classify, normalise_pci
from otel_gpu.sampling import nvml_api as api
from otel_gpu.sampling import nvml_devices as devices
from otel_gpu.sampling import nvml_processes as nvml_procs
from otel_gpu.sampling import odd_values as odd
from otel_gpu.sampling.kmsg import KernelLog
from otel_gpu.sampling.nvml_api import Device, Sweep
from otel_gpu.sampling.nvml_guard import CallGuard
from otel_gpu.sampling.snapshot import (
    STATUS_DEGRADED,
    STATUS_FAILED,
    STATUS_OK,
    GpuProcessSample,
    GpuSample,
)
from otel_gpu.sampling.source import DeviceReading, HostInfo
from otel_gpu.sampling.visible_devices import select_visible

log = logging.getLogger("otel_gpu.nvml")
# "No GPU" reasons already logged in this process: a command opens NVML twice (the resource
# detector, then the agent), and one machine without a GPU is worth one line, not two.
_REPORTED_NO_GPU: set[str] = set()


class NvmlSource:
    """Reads the selected GPUs through NVML; never raises from :meth:`sample`."""

    def __init__(
        self,
        *,
        call_timeout_s: float = 2.0,
        library_path: str | None = None,
        visible_devices: str | None = None,
        sweep_timeout_s: float | None = None,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
        lost_retry_s: float = 30.0,
        process_util_hold_s: float = 2.0,
        slow_period_s: float = api.SLOW_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        kernel_log: str | None = None,
    ) -> None:
        """``call_timeout_s``: deadline of one NVML call; ``sweep_timeout_s`` (default twice
        that): the most :meth:`sample` ever waits. ``slow_period_s``: how often the rarely
        changing metrics (``nvml_api.SLOW``) are read again. ``library_path``: load this
        libnvidia-ml by absolute path instead of the loader's search. ``visible_devices``: a
        ``CUDA_VISIBLE_DEVICES`` value selecting the job's GPUs (None: all). ``clock`` drives
        the retry schedules (init backoff, lost-GPU probes) and the slow metrics, for tests.
        ``kernel_log``: also count the Xids the driver writes there (``/dev/kmsg``; None: off),
        each event once when NVML reports it too."""
        self._guard = CallGuard(call_timeout_s, sweep_timeout_s or 2 * call_timeout_s)
        self._library_path = library_path
        self._visible = visible_devices
        self._retry_initial = retry_initial_s
        self._retry_max = retry_max_s
        self._retry_delay = retry_initial_s
        self._lost_retry = lost_retry_s
        self._util_hold_s = process_util_hold_s
        self._slow_period_s = slow_period_s
        self._clock = clock
        self._lock = threading.Lock()  # sample/host_info/close may come from different threads
        self._ready = False
        self._closed = False
        self._next_init_at = float("-inf")
        self._no_gpu_reason: str | None = "NVML not initialized yet"
        self._selection_note: str | None = None
        self._devices: list[Device] = []
        self._by_address: dict[int, Device] = {}
        self._event_set: Any = None
        self._host = HostInfo()
        self._episodes: dict[tuple[int, str], int] = {}
        self._last_code: int | None = None
        self._xids_logged: set[tuple[int, int]] = set()
        self._kernel_log = None if kernel_log is None else KernelLog(kernel_log)
        self._xid_dedup = XidDedup()
        self._pci: dict[str, str] = {}  # kernel-log bus id -> GPU UUID
        self._odd_logged: set[tuple[int, str]] = set()
        self._refresh_wanted = False  # a MIG reconfiguration was seen: enumerate again
        # NVML errors by name since start (the expected "no new sample" answers left out), for
        # the otel_gpu.agent.nvml.errors self-metric.
        self.error_counts: dict[str, int] = {}
        self._count = 0  # GPU count at the last enumeration (hot-plug changes it)
        self._pinned: set[str] | None = None  # UUIDs visible_devices chose at the first look
        # Sweeps between two reads of per-process GPU utilization (adaptive sampling,
        # otel_gpu/sampling/budget.py); the sweeps between report the last values read.
        self.process_util_every = 1
        self._sweep_count = 0

    # -- public API --------------------------------------------------------------------------

    def sample(self, job_pids: Sequence[int] = ()) -> DeviceReading:
        """Read every selected GPU and its processes once (``job_pids`` is not needed)."""
        with self._lock:
            if self._closed:
                return DeviceReading(no_gpu_reason="NVML source closed")
            if not self._ensure_ready():
                return DeviceReading(no_gpu_reason=self._no_gpu_reason)
            if self._guard.busy:  # an earlier call is still stuck: report identities only
                return self._reading(Sweep(), self._hung_key())
            sweep = Sweep()
            finished = self._guard.run(lambda: self._sweep(sweep))
            if sweep.library_error is not None:
                self._lose_library(sweep.library_error)
                return DeviceReading(no_gpu_reason=self._no_gpu_reason)
            reading = self._reading(sweep, None if finished else self._hung_key())
            if finished and self._refresh_wanted:  # read with the new devices from next sweep
                self._refresh_wanted = False
                self._guard.run(self._refresh_devices)
            return reading

    def host_info(self) -> HostInfo:
        """Driver and CUDA versions, GPU count and models (initializing NVML if needed)."""
        with self._lock:
            if not self._closed:
                self._ensure_ready()
            return self._host

    def close(self) -> None:
        """Shut NVML down (bounded by ``sweep_timeout_s``); later samples report no GPU."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._kernel_log is not None:
                self._kernel_log.close()
            if self._ready and not self._guard.busy:
                self._guard.run(self._shutdown)
            self._ready = False
            self._guard.stop()

    # -- state machine (caller thread) -------------------------------------------------------

    def _ensure_ready(self) -> bool:
        if self._ready:
            return True
        if self._guard.busy:
            self._no_gpu_reason = "NVML initialization is not responding"
            return False
        if self._clock() < self._next_init_at:
            return False
        result: dict[str, str | None] = {"reason": "NVML initialization did not finish"}
        if not self._guard.run(lambda: result.update(reason=self._init())):
            result["reason"] = (
                f"NVML initialization did not return within {self._guard.call_timeout_s:g} s"
            )
        reason = result["reason"]
        if reason is None:
            self._ready = True
            self._retry_delay = self._retry_initial
            self._no_gpu_reason = self._selection_note
            return True
        if reason != self._no_gpu_reason and reason not in _REPORTED_NO_GPU:
            _REPORTED_NO_GPU.add(reason)
            log.warning(
                "no GPU data: %s; retrying with backoff up to %g s", reason, self._retry_max
            )
        self._no_gpu_reason = reason
        self._next_init_at = self._clock() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, self._retry_max)
        return False

    def _lose_library(self, code: int) -> None:
        self._ready = False
        self._devices = []
        self._event_set = None
        reason = api.NO_GPU_REASONS.get(
            code, f"NVML stopped working ({api.ERROR_NAMES.get(code, code)})"
        )
        log.warning("no GPU data: %s; retrying with backoff", reason)
        self._no_gpu_reason = reason
        self._next_init_at = self._clock() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, self._retry_max)

    def stuck_seconds(self) -> float:
        """How long an NVML call has been stuck past its deadline (0: none is). Only a new
        process gets a working NVML back from a call that never returns."""
        return self._guard.stuck_seconds()

    def _hung_key(self) -> int | None:
        key = self._guard.hung_key
        return key[0] if isinstance(key, tuple) else None

    def _reading(self, sweep: Sweep, hung: int | None) -> DeviceReading:
        gpus = []
        for dev in self._devices:
            values = dict(sweep.fields.get(dev.key, ()))
            status = STATUS_OK
            if dev.lost:
                status, values = STATUS_FAILED, {}
            elif dev.key == hung:
                status = STATUS_DEGRADED
            gpus.append(
                GpuSample(
                    uuid=dev.uuid,
                    index=dev.index,
                    name=dev.name,
                    status=status,
                    parent=dev.parent,
                    xid_last=dev.xid_last,
                    serial=dev.serial,
                    firmware_version=dev.vbios,
                    driver_version=self._host.driver_version,
                    temperature_shutdown_c=dev.temperature_shutdown_c,
                    temperature_slowdown_c=dev.temperature_slowdown_c,
                    **values,
                )
            )
        return DeviceReading(
            gpus=tuple(gpus),
            gpu_processes=tuple(sweep.processes),
            no_gpu_reason=self._no_gpu_reason,
        )

    # -- the one guarded NVML entry point (NVML thread) --------------------------------------

    def _call(self, dev: Device | None, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` under the deadline; the value, or ``api.FAILED`` once classified."""
        guard = self._guard
        guard.enter((dev.key if dev is not None else -1, metric))
        try:
            value = fn(*args)
        except pynvml.NVMLError as err:
            guard.leave()
            self._last_code = err.value
            self._on_error(dev, metric, err.value)
            return api.FAILED
        except Exception as err:  # a binding mismatch (old pynvml, bad bytes): will not heal
            guard.leave()
            self._last_code = None
            if dev is not None:
                dev.disabled.add(metric)
            log.warning("NVML %s failed (%r); not asked again on this device", metric, err)
            return api.FAILED
        guard.leave()
        if self._episodes:  # an error episode of this (device, metric) ends with a success
            key = dev.key if dev is not None else -1
            if self._episodes.pop((key, metric), None) is not None:
                where = f"GPU {dev.index} ({dev.uuid})" if dev else "NVML"
                log.info("%s %s: readable again", where, metric)
        return value

    def _call_nvml(self, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        """:meth:`_call` for a call that concerns no device (enumeration)."""
        return self._call(None, metric, fn, *args)

    def _on_error(self, dev: Device | None, metric: str, code: int) -> None:
        if code in api.NO_LIBRARY:
            raise api.LibraryGone(code)
        if metric == "process_util" and code == pynvml.NVML_ERROR_NOT_FOUND:
            return  # no samples newer than the last one seen: an idle GPU, not an error
        if metric == "xid" and code == pynvml.NVML_ERROR_TIMEOUT:
            return  # no pending event
        if metric.startswith("mig_"):
            return  # MIG discovery probes: an error means "no MIG device there"
        if metric.startswith("identity_"):
            return  # read once; no answer (a consumer board has no serial): unknown
        if dev is not None and dev.parent is not None and code == pynvml.NVML_ERROR_NOT_FOUND:
            self._refresh_wanted = True  # this MIG device was destroyed
            return
        name = api.ERROR_NAMES.get(code, str(code))
        self.error_counts[name] = self.error_counts.get(name, 0) + 1
        where = f"GPU {dev.index} ({dev.uuid})" if dev is not None else "NVML"
        if dev is not None and code in api.UNSUPPORTED:
            dev.disabled.add(metric)
            log.info("%s: %s not available (%s); not asked again", where, metric, name)
            return
        if dev is not None and code in api.DEVICE_LOST:
            if not dev.probing:
                log.warning("%s is lost (%s); reporting it failed", where, name)
            dev.lost = True
            dev.probing = False
            dev.probe_at = self._clock() + self._lost_retry
            raise api.DeviceFailed
        key = (dev.key if dev is not None else -1, metric)
        if self._episodes.get(key) != code:
            self._episodes[key] = code
            log.warning(
                "%s: reading %s failed (%s); value unknown until it recovers", where, metric, name
            )

    # -- jobs (NVML thread) ------------------------------------------------------------------

    def _init(self) -> str | None:
        """Initialize NVML and pick the devices; a reason when there is no GPU to read."""
        if self._library_path:
            try:
                api.bind_library(self._library_path)
            except OSError as err:
                return f"cannot load NVML library {self._library_path}: {err}"
        try:
            if self._call(None, "init", pynvml.nvmlInit) is api.FAILED:
                code = self._last_code
                return api.NO_GPU_REASONS.get(
                    code, f"NVML initialization failed ({api.ERROR_NAMES.get(code, code)})"
                )
            count = self._call(None, "count", pynvml.nvmlDeviceGetCount)
            host = self._read_host(count)
        except api.LibraryGone as gone:
            return api.NO_GPU_REASONS.get(
                gone.code, f"NVML unavailable ({api.ERROR_NAMES.get(gone.code)})"
            )
        if count is api.FAILED or count == 0:
            return "NVML reports no GPU"
        found = devices.enumerate_gpus(self._call_nvml, count)
        self._select(found, count)
        self._count = count
        self._host = HostInfo(
            driver_version=host[0],
            cuda_driver_version=host[1],
            gpu_count=count,
            gpu_models=tuple(d.name or "unknown" for d in found if d is not None),
        )
        self._register_events()
        self._episodes.clear()
        return None

    def _select(
        self, found: list[Device | None], count: int, keep: Mapping[str, Device] | None = None
    ) -> None:
        """Choose the devices to read among ``found`` GPUs and their MIG devices; a device
        already in ``keep`` (by UUID) keeps its object and state (counters, disabled metrics)."""
        keep = keep or {}
        taken = {d.uuid for d in found if d is not None}
        migs = [
            mig
            for dev in found
            if dev is not None
            for mig in devices.enumerate_mig(self._call_nvml, dev, taken)
        ]
        everything = [*found, *migs]
        if self._pinned is None:
            chosen, warnings = select_visible(
                self._visible, [d.uuid if d else "" for d in found], [m.uuid for m in migs]
            )
            for warning in warnings:
                log.warning("%s", warning)
            if self._visible is not None and chosen:
                # The job's GPUs are these devices wherever NVML numbers them later: an index
                # in CUDA_VISIBLE_DEVICES must not move to another GPU after a hot-plug.
                self._pinned = {d.uuid for i in chosen if (d := everything[i]) is not None}
        else:
            chosen = [
                i for i, d in enumerate(everything) if d is not None and d.uuid in self._pinned
            ]
        selected: list[Device] = []
        for i in chosen:
            dev = everything[i]
            if dev is None or dev in selected:
                continue
            selected.append(dev)
            if i < len(found):  # a GPU in MIG mode: its MIG devices hold its memory and work
                selected += [m for m in migs if m.parent == dev.uuid and m not in selected]
        for i, dev in enumerate(selected):
            kept = keep.get(dev.uuid)
            if kept is not None:  # a GPU added or removed before it moves it to a new index
                kept.index, kept.handle, kept.address, kept.key = (
                    dev.index,
                    dev.handle,
                    dev.address,
                    dev.key,
                )
            if kept is not None and dev.parent is None and kept.mig_enabled != dev.mig_enabled:
                kept.mig_enabled = dev.mig_enabled
                kept.disabled.discard("processes")
                kept.disabled |= dev.disabled & {"processes"}
                if not dev.mig_enabled:  # what NVML lacks in MIG mode is back
                    kept.disabled -= {"utilization", "process_util"}
            selected[i] = kept or dev
        by_uuid = {d.uuid: d for d in everything if d is not None}
        for dev in selected:
            if not dev.identity_read:
                parent = by_uuid.get(dev.parent) if dev.parent else None
                if parent is not None and not parent.identity_read:
                    devices.read_identity(self._call_nvml, parent)
                devices.read_identity(self._call_nvml, dev, parent)
        self._devices = selected
        self._selection_note = None
        if not selected:
            self._selection_note = (
                f"CUDA_VISIBLE_DEVICES={self._visible!r} selects none of the {count} GPUs"
            )
        self._by_address = {d.address: d for d in selected if d.address is not None}

    def _refresh_devices(
        self, count: Any = None, reason: str = "MIG configuration changed"
    ) -> None:
        """Enumerate again after a MIG reconfiguration (MIG mode changed, or a MIG device is
        gone) or a GPU added or removed (``count``: the new GPU count); devices that stay
        (by UUID) keep their state, the others come and go."""
        if count is None:
            count = self._call(None, "count", pynvml.nvmlDeviceGetCount)
            if count is api.FAILED:
                return
        before = {d.uuid for d in self._devices}
        found = devices.enumerate_gpus(self._call_nvml, count)
        self._select(found, count, keep={d.uuid: d for d in self._devices})
        self._count = count
        self._no_gpu_reason = self._selection_note if count else "NVML reports no GPU"
        after = {d.uuid for d in self._devices}
        for dev in self._devices:
            if dev.uuid not in before:
                self._register_xid(dev)
        self._host = dataclasses.replace(
            self._host,
            gpu_count=count,
            gpu_models=tuple(d.name or "unknown" for d in found if d is not None),
        )
        log.info(
            "%s: now reading %d device(s) (%d new, %d gone)",
            reason,
            len(after),
            len(after - before),
            len(before - after),
        )

    def _follow_device_count(self) -> None:
        """Hot-plug: a GPU added or removed changes NVML's count. Enumerate again before the
        devices are read, so no value is read through a stale index-to-UUID mapping."""
        count = self._call(None, "count", pynvml.nvmlDeviceGetCount)
        if count is not api.FAILED and count != self._count:
            self._refresh_devices(count, f"GPU count changed from {self._count} to {count}")

    def _read_host(self, count: Any) -> tuple[str | None, str | None]:
        driver = self._call(None, "driver_version", pynvml.nvmlSystemGetDriverVersion)
        cuda = self._call(None, "cuda_version", pynvml.nvmlSystemGetCudaDriverVersion)
        driver = None if driver is api.FAILED else api.text(driver)
        cuda = None if cuda is api.FAILED or not cuda else f"{cuda // 1000}.{cuda % 1000 // 10}"
        return driver, cuda

    def _register_events(self) -> None:
        create = api.function("nvmlEventSetCreate")
        event_set = api.FAILED if create is None else self._call(None, "event_set", create)
        self._event_set = None if event_set is api.FAILED else event_set
        for dev in self._devices:
            self._register_xid(dev)

    def _register_xid(self, dev: Device) -> None:
        if self._event_set is not None and dev.parent is None:  # Xids come per GPU
            ok = self._call(
                dev,
                "xid_register",
                pynvml.nvmlDeviceRegisterEvents,
                dev.handle,
                api.XID_EVENT,
                self._event_set,
            )
            dev.xid_count = None if ok is api.FAILED else 0

    def _shutdown(self) -> None:
        if self._event_set is not None:
            self._call(None, "event_set_free", pynvml.nvmlEventSetFree, self._event_set)
        self._call(None, "shutdown", pynvml.nvmlShutdown)

    def _sweep(self, sweep: Sweep) -> None:
        try:
            self._follow_device_count()
            now = self._clock()
            self._sweep_count += 1
            for dev in self._devices:
                if dev.lost:
                    if now < dev.probe_at:
                        continue
                    dev.lost, dev.probing = False, True  # a full read decides
                values: dict[str, Any] = {}
                sweep.fields[dev.key] = values
                began = time.perf_counter()
                try:
                    self._read_device(dev, values, sweep.processes, now)
                except api.DeviceFailed:
                    values.clear()
                    continue
                values["read_seconds"] = time.perf_counter() - began
                if dev.probing:
                    dev.probing = False
                    log.info("GPU %s (%s) is readable again", dev.index, dev.uuid)
            self._read_events(sweep)
            self._read_kernel_log(sweep)
        except api.LibraryGone as gone:
            sweep.library_error = gone.code

    def _read_device(
        self, dev: Device, out: dict[str, Any], procs: list[GpuProcessSample], now: float
    ) -> None:
        call, h, off = self._call, dev.handle, dev.disabled
        slow_due = now >= dev.slow_at
        if slow_due:
            dev.slow_values = {}
            dev.slow_at = now + self._slow_period_s
        else:
            out.update(dev.slow_values)
        metric, m = self._first(dev, api.MEMORY)
        if metric is not None:
            # v2 "used" excludes the driver-reserved part; report NVML's classic "used"
            v2 = metric == "memory_v2"
            total, in_use, reserved, why = odd.memory(
                m.total, m.used + m.reserved if v2 else m.used, m.reserved if v2 else None
            )
            out.update(memory_total=total, memory_used=in_use, memory_reserved=reserved)
            if why:
                self._odd(dev, "memory", why)
        if "utilization" not in off:
            u = call(dev, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
            if u is not api.FAILED:
                out.update(util_gpu=odd.fraction(u.gpu), util_memory=odd.fraction(u.memory))
                if out["util_gpu"] is None or out["util_memory"] is None:
                    self._odd(dev, "utilization", f"gpu {u.gpu} %, memory {u.memory} %: skipped")
        metric, t = self._first(dev, api.TEMPERATURE)
        if metric is not None:
            out["temperature_c"] = odd.temperature(t)
            if out["temperature_c"] is None:
                self._odd(dev, "temperature", f"{t} C: skipped")
        for metric, name, fn, args, conv in api.SCALARS:
            if metric not in off and fn is not None:
                slow = metric in api.SLOW
                if slow and not (slow_due or metric in dev.active_lists):
                    continue
                v = call(dev, metric, fn, h, *args)
                if v is not api.FAILED:
                    out[name] = value = conv(v)
                    if value is None:
                        self._odd(dev, metric, f"{v!r}: skipped")
                    if slow:
                        dev.slow_values[name] = value
                        if metric == "mig" and dev.mig_enabled not in (None, value):
                            self._refresh_wanted = True  # MIG turned on or off
                        if metric in api.IDLE_ENGINES:  # in use: read every sweep
                            if value:
                                dev.active_lists.add(metric)
                            else:
                                dev.active_lists.discard(metric)
        if dev.xid_count is not None:
            out["xid_errors"] = dev.xid_count
            out.update(_xid_class_fields(dev))
        out["processes_listed"] = False
        if "processes" in off:
            return
        listed = call(dev, "processes", nvml_procs.running_processes, h)
        out["processes_listed"] = listed is not api.FAILED
        used: dict[int, int | None] = {} if listed is api.FAILED else dict(listed)
        for which in (nvml_procs.GRAPHICS, nvml_procs.MPS):
            kind = which[0]
            if kind in off or not (slow_due or kind in dev.active_lists):
                continue
            more = call(dev, kind, nvml_procs.running_processes, h, which)
            if more is api.FAILED or not more:
                dev.active_lists.discard(kind)
                continue
            dev.active_lists.add(kind)
            for pid, mem in more:  # a process in two lists ("C+G") holds its memory once
                known = used.get(pid)
                used[pid] = mem if known is None else max(known, mem or 0)
        if used:
            util: dict[int, tuple[float | None, float | None]] = {}
            if "process_util" not in off:
                due = self._sweep_count % max(1, self.process_util_every) == 0
                util = self._process_util(dev) if due or not dev.util_last else dev.util_last
            total = out.get("memory_total")
            for pid, mem in used.items():
                sm, mem_util = util.get(pid, (None, None))
                checked = odd.process_memory(mem, total)
                if checked != mem:
                    self._odd(dev, "process_memory", f"PID {pid} {mem} B > {total} B: skipped")
                procs.append(GpuProcessSample(pid, dev.uuid, checked, sm, mem_util))

    def _first(self, dev: Device, alternatives: api.Alternatives) -> tuple[str | None, Any]:
        """The first alternative this device supports: (metric, value), or (None, api.FAILED)."""
        for metric, fn, args in alternatives:
            if metric in dev.disabled or fn is None:
                continue
            value = self._call(dev, metric, fn, dev.handle, *args)
            if value is not api.FAILED:
                return metric, value
            if metric not in dev.disabled:
                break  # a transient failure: unknown this sweep, no fallback needed
        return None, api.FAILED

    def _odd(self, dev: Device, metric: str, what: str) -> None:
        """Log an odd reading (``what``: the value and what was done) once per device and
        metric; the rules are odd_values'."""
        if (dev.key, metric) not in self._odd_logged:
            self._odd_logged.add((dev.key, metric))
            log.warning(
                "GPU %s (%s): odd %s reading, %s (docs/metrics.md: Odd values); not logged again",
                dev.index,
                dev.uuid,
                metric,
                what,
            )

    def _process_util(self, dev: Device) -> dict[int, tuple[float | None, float | None]]:
        """Per-PID (sm, mem) fractions: the average of the samples newer than the last one seen.
        When NVML has nothing newer (NOT_FOUND: idle, or asked again within its sample period)
        the previous values are held for ``process_util_hold_s``, then unknown. Samples stamped
        in the future (beyond ``odd.SAMPLE_CLOCK_SLACK_S``) or not after the last one seen are
        ignored and never move the last-seen stamp; values above 100 % are left out."""
        samples = self._call(
            dev,
            "process_util",
            pynvml.nvmlDeviceGetProcessUtilization,
            dev.handle,
            dev.util_seen_us,
        )
        now = time.monotonic()
        sums: dict[int, list[float]] = {}  # PID -> [sm sum, sm count, mem sum, mem count]
        if samples is not api.FAILED and samples:
            horizon = (time.time() + odd.SAMPLE_CLOCK_SLACK_S) * 1e6  # NVML stamps: wall µs
            seen, odd_samples = dev.util_seen_us, 0
            for s in samples:
                if not dev.util_seen_us < s.timeStamp <= horizon:
                    odd_samples += 1
                    continue
                seen = max(seen, s.timeStamp)
                acc = sums.setdefault(s.pid, [0.0, 0, 0.0, 0])
                for i, value in ((0, s.smUtil), (2, s.memUtil)):
                    if 0 <= value <= 100:
                        acc[i] += value
                        acc[i + 1] += 1
                    else:
                        odd_samples += 1
            dev.util_seen_us = seen
            if odd_samples:
                self._odd(dev, "process_util", f"{odd_samples} sample value(s) left out")
        if sums:
            dev.util_last = {
                pid: (sm / n / 100 if n else None, mem / k / 100 if k else None)
                for pid, (sm, n, mem, k) in sums.items()
            }
            dev.util_at = now
        elif now - dev.util_at > self._util_hold_s:
            dev.util_last = {}
        return dev.util_last

    def _read_events(self, sweep: Sweep) -> None:
        if self._event_set is None:
            return
        for _ in range(api.MAX_EVENTS_PER_SWEEP):
            data = self._call(None, "xid", pynvml.nvmlEventSetWait_v2, self._event_set, 0)
            if data is api.FAILED:
                return
            if data.eventType & api.XID_EVENT:
                dev = self._by_address.get(ctypes.cast(data.device, ctypes.c_void_p).value or 0)
                if dev is not None and dev.xid_count is not None:
                    self._count_xid(sweep, dev, int(data.eventData))
                    if (dev.index, data.eventData) not in self._xids_logged:  # Xid storms
                        self._xids_logged.add((dev.index, data.eventData))
                        log.warning("GPU %s (%s): Xid %s", dev.index, dev.uuid, data.eventData)

    def _count_xid(self, sweep: Sweep, dev: Device, code: int, source: str = "nvml") -> None:
        """One Xid event on ``dev`` (from NVML's events or the kernel log), counted once."""
        if dev.xid_count is None:
            dev.xid_count = 0  # the kernel log reports Xids where NVML's events are off
        if not self._xid_dedup.is_new(dev.uuid, code, source, self._clock()):
            return
        dev.xid_count += 1
        cls = classify(code).cls
        dev.xid_classes[cls] = dev.xid_classes.get(cls, 0) + 1
        dev.xid_last = code  # kept, and shown even once it is lost
        values = sweep.fields.get(dev.key)
        if values is not None and not dev.lost:
            values["xid_errors"] = dev.xid_count
            values.update(_xid_class_fields(dev))
            # which Xid, for readiness gates that tell fatal codes from benign ones
            values["xid_codes"] = (*values.get("xid_codes", ()), code)

    def _read_kernel_log(self, sweep: Sweep) -> None:
        if self._kernel_log is None:
            return
        found = self._kernel_log.poll()
        if not found:
            return
        by_uuid = {d.uuid: d for d in self._devices if d.parent is None}
        for dev in by_uuid.values():
            if dev.uuid not in self._pci.values():
                info = self._call(dev, "pci", pynvml.nvmlDeviceGetPciInfo, dev.handle)
                if info is not api.FAILED:
                    self._pci[normalise_pci(api.text(info.busId))] = dev.uuid
        for event in found:
            target = by_uuid.get(self._pci.get(event.pci, ""))
            if target is None:
                continue  # a GPU this agent does not watch
            self._count_xid(sweep, target, event.code, "kmsg")
            if (target.index, event.code) not in self._xids_logged:
                self._xids_logged.add((target.index, event.code))
                log.warning(
                    "GPU %s (%s): Xid %s (kernel log)", target.index, target.uuid, event.code
                )


def _xid_class_fields(dev: Device) -> dict[str, int]:
    """The GpuSample fields of a device's Xid counts by class (0 for a class not seen yet)."""
    return {f"xid_{cls}": dev.xid_classes.get(cls, 0) for cls in CLASSES}
