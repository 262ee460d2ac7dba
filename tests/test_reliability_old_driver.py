"""docs/reliability.md section A case 11, an old driver: the legacy build of the fake NVML lacks the
symbols newer drivers added (the _v3 process lists, memory info v2, TemperatureV, the "clocks
event" name of the throttle reasons); the agent reads the same values through the older ones.
"""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
from fakenvml.fixtures import FakeNvml

pytestmark = pytest.mark.unit

OLD_DRIVER_SCENARIO = """
devices = 2
gpu.0.processes = 4242:1073741824 4343:na
gpu.0.graphics_processes = 4444:2048
gpu.0.mps_processes = 4545:4096
gpu.0.memory.reserved = 1000000
gpu.0.temperature = 61
gpu.0.clocks_event_reasons = 0x24
"""
# library -> the NVML symbols that must answer for processes, memory and temperature
SYMBOLS_USED = {
    "current": (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetCurrentClocksEventReasons",
    ),
    "legacy": (
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ),
}


@pytest.mark.parametrize("driver", sorted(SYMBOLS_USED))
def test_an_old_driver_is_read_through_the_older_functions(
    request: pytest.FixtureRequest,
    driver: str,
    fake_nvml_library: Path,
    fake_nvml_legacy_library: Path,
):
    """A driver without the _v3 process lists, memory info v2, TemperatureV and the "clocks
    event" name (the legacy build) still gives every process list, the memory, the temperature
    and the throttle reasons, through _v2, v1, nvmlDeviceGetTemperature and the "throttle"
    name; a current one is read through the newest functions only."""
    # both builds are the session's (set up before this test, whichever runs first)
    fake: FakeNvml = request.getfixturevalue("legacy_nvml" if driver == "legacy" else "fake_nvml")
    fake.write(OLD_DRIVER_SCENARIO)
    src = fake.source()
    for _ in range(3):
        reading = src.sample([])
        gpu0 = reading.gpus[0]
        assert gpu0.processes_listed and gpu0.temperature_c == 61.0
        assert gpu0.throttle_reasons == 0x24
        assert gpu0.memory_used is not None and gpu0.memory_total is not None
        used = {(p.pid, p.used_memory) for p in reading.gpu_processes}
        assert used == {(4242, 1073741824), (4343, None), (4444, 2048), (4545, 4096)}
    # memory info v1 has no reserved part; v2 has (reported, and part of "used")
    assert gpu0.memory_reserved == (None if driver == "legacy" else 1000000)
    others = {s for d, symbols in SYMBOLS_USED.items() if d != driver for s in symbols}
    assert all(fake.call_count(s, gpu=0) >= 3 for s in SYMBOLS_USED[driver])
    assert not [s for s in others if fake.call_count(s)]  # absent, or not needed
    # memory v2 and TemperatureV missing: found once per GPU, then not asked again
    assert src.error_counts == ({"FUNCTION_NOT_FOUND": 4} if driver == "legacy" else {})


def test_pynvml_unversioned_process_list_raises_library_mismatch_on_an_old_driver(
    legacy_nvml: FakeNvml,
):
    """Why the agent never calls pynvml's unversioned process lists: on a driver without _v3
    they raise NVMLLibraryMismatchError (not an NVMLError), where the agent's own two-call
    reader falls back to _v2 and lists the process."""
    legacy_nvml.write("devices = 1\ngpu.0.processes = 4242:1048576")
    src = legacy_nvml.source()
    assert [p.pid for p in src.sample([]).gpu_processes] == [4242]  # binds the legacy library
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(handle)] == [4242]
