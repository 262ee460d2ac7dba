"""MIG devices in the C fake of libnvidia-ml.so.1 (tests/fakenvml), through the real pynvml.

Scenario lines ``mig.N.I.<field> = value`` declare MIG device I of GPU N; they are reachable
while ``gpu.N.mig = 1``. See tests/fakenvml/README.md.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import pynvml
import pytest
from fakenvml.fixtures import FakeNvml

from otel_gpu.sampling import nvml_api

NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG mode
GIB = 1 << 30


@pytest.fixture
def nvml(fake_nvml: FakeNvml) -> Iterator[FakeNvml]:
    """pynvml bound to the fake and initialized (the scenario is ``fake_nvml.write``-able)."""
    nvml_api.bind_library(str(fake_nvml.library))
    pynvml.nvmlInit()
    try:
        yield fake_nvml
    finally:
        pynvml.nvmlShutdown()


def code_of(fn, *args) -> int:
    """The NVML error code ``fn(*args)`` raises through pynvml (NVML_SUCCESS if none)."""
    try:
        fn(*args)
    except pynvml.NVMLError as err:
        return err.value
    return pynvml.NVML_SUCCESS


def address(handle) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value


def gpu(index: int):
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def mig(parent: int, index: int):
    return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(parent), index)


def text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def procs(fn, handle) -> list[tuple[int, int | None, int, int]]:
    """(pid, usedGpuMemory, gpuInstanceId, computeInstanceId) of the raw v3 entries."""
    return [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in fn(handle)]


# ---- enumeration -------------------------------------------------------------------------------


@pytest.mark.unit
def test_enumerate_mig_devices_of_a_mig_enabled_gpu(nvml: FakeNvml):
    nvml.write(
        """
        devices = 2
        gpu.0.mig = 1
        mig.0.0.name = first
        mig.0.2.name = third
        mig.1.0.name = unreachable   # GPU 1 is not in MIG mode
        """
    )
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu(0)) == 7
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu(1)) == 0
    h0, h2 = mig(0, 0), mig(0, 2)
    assert (text(pynvml.nvmlDeviceGetName(h0)), text(pynvml.nvmlDeviceGetName(h2))) == (
        "first",
        "third",
    )
    # Distinct from each other and from every GPU handle; the same value on every call.
    addresses = {address(h0), address(h2), address(gpu(0)), address(gpu(1))}
    assert len(addresses) == 4
    assert address(mig(0, 2)) == address(h2)
    # Slots without a declared instance, past the maximum, and on a GPU with MIG off.
    for index in (1, 3, 6):
        assert code_of(mig, 0, index) == pynvml.NVML_ERROR_NOT_FOUND
    assert code_of(mig, 0, 7) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code_of(mig, 1, 0) == pynvml.NVML_ERROR_INVALID_ARGUMENT


@pytest.mark.unit
def test_mig_handle_is_not_a_parent(nvml: FakeNvml):
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.0.gi = 1")
    h = mig(0, 0)
    assert code_of(pynvml.nvmlDeviceGetMaxMigDeviceCount, h) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert (
        code_of(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 0)
        == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )


@pytest.mark.unit
def test_parent_round_trip_and_is_mig_device_handle(nvml: FakeNvml):
    nvml.write("devices = 2\ngpu.*.mig = 1\nmig.1.3.gi = 5")
    h = mig(1, 3)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(h).value == 1
    assert pynvml.nvmlDeviceIsMigDeviceHandle(gpu(1)).value == 0
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
    assert address(parent) == address(gpu(1))
    assert text(pynvml.nvmlDeviceGetUUID(parent)) == text(pynvml.nvmlDeviceGetUUID(gpu(1)))
    assert (
        code_of(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, gpu(1))
        == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )


# ---- what a MIG device reports -----------------------------------------------------------------


@pytest.mark.unit
def test_instance_defaults(nvml: FakeNvml):
    nvml.write(
        """
        devices = 2
        gpu.1.mig = 1
        mig.1.2.gi = 3
        gpu.1.name = NVIDIA A100-SXM4-80GB   # after the mig line: the default name follows it
        """
    )
    h = mig(1, 2)
    assert text(pynvml.nvmlDeviceGetUUID(h)) == "MIG-00000001-0002-4000-8000-000000000000"
    assert text(pynvml.nvmlDeviceGetName(h)) == "NVIDIA A100-SXM4-80GB MIG"
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    assert (mem.total, mem.used, mem.free) == (10 * GIB, 0, 10 * GIB)
    assert pynvml.nvmlDeviceGetComputeInstanceId(h) == 0
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.4.ci = 0")
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig(0, 4)) == 5  # default: I + 1


@pytest.mark.unit
def test_instance_uuid_name_and_memory_with_a_ramp(nvml: FakeNvml):
    nvml.write(
        """
        devices = 1
        gpu.0.mig = 1
        gpu.0.memory.total = 85899345920
        gpu.0.memory.used = 1000
        mig.0.1.uuid = MIG-5d3c0000-1111-4000-8000-000000000001
        mig.0.1.name = NVIDIA A100-SXM4-80GB MIG 3g.40gb
        mig.0.1.memory.total = 42949672960
        mig.0.1.memory.used = 1e9+1e9/s
        mig.0.1.memory.reserved = 1000000
        """
    )
    h = mig(0, 1)
    assert text(pynvml.nvmlDeviceGetUUID(h)) == "MIG-5d3c0000-1111-4000-8000-000000000001"
    assert text(pynvml.nvmlDeviceGetName(h)) == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    before = time.time() - nvml.t0
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    after = time.time() - nvml.t0
    low, high = 1e9 + 1e9 * before - 1, 1e9 + 1e9 * after + 1
    assert v1.total == v2.total == 42949672960
    assert low <= v1.used <= high  # v1 "used" includes reserved
    assert v1.free == v1.total - v1.used
    assert v2.reserved == 1000000
    assert low <= v2.used + v2.reserved <= high  # v2 "used" excludes it
    assert v2.free == v2.total - v2.used - v2.reserved
    time.sleep(0.05)
    assert pynvml.nvmlDeviceGetMemoryInfo(h).used > v1.used  # the ramp rises
    # The parent keeps its own memory (gpu.0.memory.*).
    parent = pynvml.nvmlDeviceGetMemoryInfo(gpu(0))
    assert (parent.total, parent.used) == (85899345920, 1000)


@pytest.mark.unit
def test_gpu_and_compute_instance_ids(nvml: FakeNvml):
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.0.gi = 7\nmig.0.0.ci = 2\nmig.0.6.name = x")
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig(0, 0)) == 7
    assert pynvml.nvmlDeviceGetComputeInstanceId(mig(0, 0)) == 2
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig(0, 6)) == 7  # default I + 1
    assert pynvml.nvmlDeviceGetComputeInstanceId(mig(0, 6)) == 0
    for fn in (pynvml.nvmlDeviceGetGpuInstanceId, pynvml.nvmlDeviceGetComputeInstanceId):
        assert code_of(fn, gpu(0)) == pynvml.NVML_ERROR_INVALID_ARGUMENT


@pytest.mark.unit
def test_gpu_wide_queries_are_not_supported_on_a_mig_handle(nvml: FakeNvml):
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.0.gi = 1")
    h, parent = mig(0, 0), gpu(0)
    queries = [
        (pynvml.nvmlDeviceGetPowerUsage,),
        (pynvml.nvmlDeviceGetEnforcedPowerLimit,),
        (pynvml.nvmlDeviceGetTotalEnergyConsumption,),
        (pynvml.nvmlDeviceGetUtilizationRates,),
        (pynvml.nvmlDeviceGetEncoderUtilization,),
        (pynvml.nvmlDeviceGetDecoderUtilization,),
        (pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        (pynvml.nvmlDeviceGetTemperatureV, pynvml.NVML_TEMPERATURE_GPU),
        (pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        (pynvml.nvmlDeviceGetPcieThroughput, pynvml.NVML_PCIE_UTIL_TX_BYTES),
        (
            pynvml.nvmlDeviceGetTotalEccErrors,
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        ),
        (pynvml.nvmlDeviceGetMigMode,),
        (pynvml.nvmlDeviceGetCurrentClocksEventReasons,),
        (pynvml.nvmlDeviceGetProcessUtilization, 0),
        (pynvml.nvmlDeviceGetIndex,),
        (pynvml.nvmlDeviceGetPciInfo,),
        (pynvml.nvmlDeviceGetSupportedEventTypes,),
    ]
    for fn, *args in queries:
        assert code_of(fn, h, *args) == pynvml.NVML_ERROR_NOT_SUPPORTED, fn.__name__
    events = pynvml.nvmlEventSetCreate()
    try:
        assert (
            code_of(
                pynvml.nvmlDeviceRegisterEvents, h, pynvml.nvmlEventTypeXidCriticalError, events
            )
            == pynvml.NVML_ERROR_NOT_SUPPORTED
        )
    finally:
        pynvml.nvmlEventSetFree(events)
    # The same queries work on the parent (utilization and process samples aside: MIG mode).
    assert pynvml.nvmlDeviceGetPowerUsage(parent) == 70000
    assert pynvml.nvmlDeviceGetIndex(parent) == 0
    assert pynvml.nvmlDeviceGetMigMode(parent) == [1, 0]


@pytest.mark.unit
def test_parent_in_mig_mode_has_no_utilization(nvml: FakeNvml):
    nvml.write(
        """
        devices = 2
        gpu.*.util.gpu = 55
        gpu.*.process_util = 100:10:20
        gpu.0.mig = 1
        mig.0.0.gi = 1
        mig.1.0.gi = 1       # GPU 1 is not in MIG mode: unchanged
        """
    )
    assert code_of(pynvml.nvmlDeviceGetUtilizationRates, gpu(0)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert (
        code_of(pynvml.nvmlDeviceGetProcessUtilization, gpu(0), 0)
        == pynvml.NVML_ERROR_NOT_SUPPORTED
    )
    assert pynvml.nvmlDeviceGetUtilizationRates(gpu(1)).gpu == 55
    assert [s.pid for s in pynvml.nvmlDeviceGetProcessUtilization(gpu(1), 0)] == [100]
    assert pynvml.nvmlDeviceGetTemperature(gpu(0), pynvml.NVML_TEMPERATURE_GPU) == 35
    nvml.append("gpu.0.mig = 0")  # MIG mode off again: the whole-GPU value is back
    assert pynvml.nvmlDeviceGetUtilizationRates(gpu(0)).gpu == 55


@pytest.mark.unit
def test_process_lists_per_instance_and_the_parents_aggregate(nvml: FakeNvml):
    nvml.write(
        """
        devices = 2
        gpu.0.mig = 1
        gpu.0.processes = 9999:1      # the GPU's own list: not used in MIG mode
        mig.0.0.gi = 1
        mig.0.0.ci = 0
        mig.0.0.processes = 100:1000 101:na
        mig.0.0.graphics_processes = 110:3000
        mig.0.2.gi = 2
        mig.0.2.ci = 1
        mig.0.2.processes = 200:2000
        mig.0.2.mps_processes = 220:4000
        gpu.1.processes = 300:5000
        """
    )
    compute = pynvml.nvmlDeviceGetComputeRunningProcesses
    graphics = pynvml.nvmlDeviceGetGraphicsRunningProcesses
    mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses
    a, b = mig(0, 0), mig(0, 2)
    assert procs(compute, a) == [(100, 1000, 1, 0), (101, None, 1, 0)]
    assert procs(compute, b) == [(200, 2000, 2, 1)]
    assert procs(graphics, a) == [(110, 3000, 1, 0)]
    assert procs(graphics, b) == []
    assert procs(mps, a) == []
    assert procs(mps, b) == [(220, 4000, 2, 1)]
    # The parent: the union of its instances' lists, each entry with its instance's ids.
    assert procs(compute, gpu(0)) == [(100, 1000, 1, 0), (101, None, 1, 0), (200, 2000, 2, 1)]
    assert procs(graphics, gpu(0)) == [(110, 3000, 1, 0)]
    assert procs(mps, gpu(0)) == [(220, 4000, 2, 1)]
    # A GPU outside MIG mode: its own list, no instance ids.
    assert procs(compute, gpu(1)) == [(300, 5000, NO_INSTANCE, NO_INSTANCE)]


@pytest.mark.unit
def test_mig_lines_change_nothing_while_mig_is_off(nvml: FakeNvml):
    nvml.write(
        """
        devices = 1
        gpu.0.processes = 300:5000
        gpu.0.util.gpu = 40
        mig.0.0.processes = 100:1000
        """
    )
    assert procs(pynvml.nvmlDeviceGetComputeRunningProcesses, gpu(0)) == [
        (300, 5000, NO_INSTANCE, NO_INSTANCE)
    ]
    assert pynvml.nvmlDeviceGetUtilizationRates(gpu(0)).gpu == 40
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu(0)) == 0
    nvml.append("gpu.0.mig = 1")  # MIG mode on: the same lines now make instance 0
    assert procs(pynvml.nvmlDeviceGetComputeRunningProcesses, gpu(0)) == [(100, 1000, 1, 0)]


# ---- counting, rules, reloads ------------------------------------------------------------------


@pytest.mark.unit
def test_calls_on_a_mig_handle_count_under_the_parent_gpu(nvml: FakeNvml):
    nvml.write("devices = 2\ngpu.*.mig = 1\nmig.1.0.gi = 1\nmig.0.0.gi = 1")
    h = mig(1, 0)
    nvml.reset_counts()
    pynvml.nvmlDeviceGetUUID(h)
    pynvml.nvmlDeviceGetMemoryInfo(h)
    pynvml.nvmlDeviceGetMemoryInfo(h)
    code_of(pynvml.nvmlDeviceGetPowerUsage, h)  # NOT_SUPPORTED: still a call
    pynvml.nvmlDeviceGetGpuInstanceId(h)
    assert nvml.call_count("nvmlDeviceGetMemoryInfo", gpu=1) == 2
    assert nvml.call_count("nvmlDeviceGetPowerUsage", gpu=1) == 1
    assert nvml.call_count("nvmlDeviceGetGpuInstanceId", gpu=1) == 1
    assert nvml.call_count("*", gpu=1) == 5
    assert nvml.call_count("*", gpu=0) == 0
    assert nvml.call_count("*", gpu=-1) == 0
    pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu(0))
    pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(0), 0)
    assert nvml.call_count("nvmlDeviceGetMaxMigDeviceCount", gpu=0) == 1
    assert nvml.call_count("nvmlDeviceGetMigDeviceHandleByIndex", gpu=0) == 1


@pytest.mark.unit
def test_rules_on_the_parent_index_hit_its_mig_devices(nvml: FakeNvml):
    nvml.write("devices = 2\ngpu.*.mig = 1\nmig.0.0.gi = 1\nmig.1.0.gi = 1")
    h0, h1 = mig(0, 0), mig(1, 0)
    nvml.append("fail.*.0 = GPU_IS_LOST")
    assert code_of(pynvml.nvmlDeviceGetUUID, h0) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert code_of(pynvml.nvmlDeviceGetMemoryInfo, h0) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert code_of(pynvml.nvmlDeviceGetGpuInstanceId, h0) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert pynvml.nvmlDeviceGetGpuInstanceId(h1) == 1  # GPU 1's instance is untouched
    nvml.write(
        """
        devices = 2
        gpu.*.mig = 1
        mig.0.0.gi = 1
        mig.1.0.gi = 1
        fail.nvmlDeviceGetMemoryInfo.1 = TIMEOUT after=1
        delay.nvmlDeviceGetUUID.1 = 300 until=1
        """
    )
    start = time.monotonic()
    pynvml.nvmlDeviceGetUUID(h1)  # first call on GPU 1: delayed
    assert time.monotonic() - start >= 0.3
    pynvml.nvmlDeviceGetMemoryInfo(h1)  # call 1 passes, later ones fail
    assert code_of(pynvml.nvmlDeviceGetMemoryInfo, h1) == pynvml.NVML_ERROR_TIMEOUT
    assert pynvml.nvmlDeviceGetMemoryInfo(h0).total == 10 * GIB


@pytest.mark.unit
def test_handles_survive_reloads_and_removed_instances_are_not_found(nvml: FakeNvml):
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.3.name = before")
    h = mig(0, 3)
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.3.name = after\nmig.0.1.name = other")
    assert address(mig(0, 3)) == address(h)  # same value after the reload
    assert text(pynvml.nvmlDeviceGetName(h)) == "after"  # the old handle still works
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.1.name = other")  # instance 3 removed
    for fn in (
        pynvml.nvmlDeviceGetName,
        pynvml.nvmlDeviceGetUUID,
        pynvml.nvmlDeviceGetMemoryInfo,
        pynvml.nvmlDeviceGetPowerUsage,
        pynvml.nvmlDeviceGetGpuInstanceId,
        pynvml.nvmlDeviceIsMigDeviceHandle,
    ):
        assert code_of(fn, h) == pynvml.NVML_ERROR_NOT_FOUND, fn.__name__
    assert code_of(mig, 0, 3) == pynvml.NVML_ERROR_NOT_FOUND
    nvml.write("devices = 1\ngpu.0.mig = 1\nmig.0.3.name = back")  # recreated: same handle
    assert address(mig(0, 3)) == address(h)
    assert text(pynvml.nvmlDeviceGetName(h)) == "back"
    nvml.write("devices = 1\nmig.0.3.name = back")  # MIG mode off: the instance is gone
    assert code_of(pynvml.nvmlDeviceGetName, h) == pynvml.NVML_ERROR_NOT_FOUND


@pytest.mark.unit
@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("mig.0.6.name = x", "mig.0.7.name = x"),  # instance index past 6
        ("mig.63.0.name = x", "mig.64.0.name = x"),  # GPU index past 63
        ("mig.0.0.name = x", "mig.*.*.name = x"),  # no wildcards
        ("mig.0.0.name = x", "mig.0.*.name = x"),
        ("mig.0.0.name = x", "mig.0.name = x"),  # no instance part
        ("mig.0.0.gi = 1", "mig.0.0 = 1"),  # no field
        ("mig.0.0.memory.total = 1", "mig.0.0.power.usage = 1"),  # not a MIG field
        ("mig.0.0.memory.used = 5+1/s", "mig.0.0.memory.used = lots"),
        ("mig.0.0.processes = 100:na", "mig.0.0.processes = 100"),  # no :USED
        ("mig.0.0.gi = 0", "mig.0.0.gi = -1"),
        ("mig.0.0.ci = 2", "mig.0.0.ci = two"),
        ("mig.1.0.name = x", "mig.-1.0.name = x"),
        ("mig.0.1.name = x", "mig.0.+1.name = x"),
    ],
)
def test_malformed_mig_lines_are_rejected(fake_nvml: FakeNvml, good: str, bad: str):
    fake_nvml.write(f"devices = 1\ngpu.0.mig = 1\n{good}")  # the well-formed neighbour parses
    with pytest.raises(ValueError, match="cannot parse"):
        fake_nvml.write(f"devices = 1\ngpu.0.mig = 1\n{bad}")


@pytest.mark.process
def test_child_process_enumerates_mig_devices_by_name(fake_nvml: FakeNvml):
    """The same through pynvml's own CDLL("libnvidia-ml.so.1") in a child process."""
    fake_nvml.write("devices = 2\ngpu.1.mig = 1\nmig.1.5.name = Fake MIG 1g.10gb")
    printed = fake_nvml.run_python(
        """
        import pynvml
        pynvml.nvmlInit()
        g = pynvml.nvmlDeviceGetHandleByIndex(1)
        h = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(g, 5)
        print(pynvml.nvmlDeviceGetMaxMigDeviceCount(g), pynvml.nvmlDeviceGetUUID(h))
        pynvml.nvmlShutdown()
        """
    )
    assert printed == ["7", "MIG-00000001-0005-4000-8000-000000000000"]
    assert fake_nvml.child_stats()[("nvmlDeviceGetMigDeviceHandleByIndex", 1)] == 1
    assert fake_nvml.child_stats()[("nvmlDeviceGetUUID", 1)] == 1
