"""The drivers people have: the fake NVML built as each driver branch (tests/fakenvml/build.py
DRIVERS, docs/sampling.md "Driver branches") exports the process-list entry points that branch's
nvml.h declares and fills entries of the size it gives; the agent reads PIDs and memory right
on every one, including 535.43.02-535.86.x whose _v3 entries are 32 bytes.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import pynvml
import pytest
from fakenvml.build import DRIVERS
from fakenvml.fixtures import FakeNvml

from otel_gpu.sampling import nvml_processes

pytestmark = pytest.mark.unit

LISTS = ("Compute", "Graphics", "MPSCompute")
# branch -> (process-list versions exported, _v3 entry size, detail list, conf compute)
EXPORTS = {
    "r470": (("", "_v2"), None, False, False),
    "r510": (("", "_v2", "_v3"), 24, False, False),
    "r535.43": (("", "_v2", "_v3"), 32, False, True),
    "r535.98": (("", "_v2"), None, False, True),
    "r535.104": (("", "_v2", "_v3"), 24, True, True),
    "current": (("", "_v2", "_v3"), 24, True, True),
}
BRANCHES = sorted(DRIVERS)

# CC protected memory (the third number) only shows in 32-byte entries; nonzero here so that a
# 24-byte reading of them would garble every PID after the first, not only zero them.
SCENARIO = """
devices = 2
gpu.0.processes = 4242:1073741824:536870912 4343:na 4444:2147483648:4096
gpu.0.graphics_processes = 4545:2048
gpu.0.mps_processes = 4646:4096 4747:8192
gpu.1.mig = 1
mig.1.0.processes = 5151:1048576 5252:2097152
mig.1.1.processes = 5353:3145728
"""
EXPECTED = {
    (4242, 1073741824, 0),
    (4343, None, 0),
    (4444, 2147483648, 0),
    (4545, 2048, 0),
    (4646, 4096, 0),
    (4747, 8192, 0),
    (5151, 1048576, 1),
    (5252, 2097152, 1),
    (5353, 3145728, 1),
}


def exported(fake: FakeNvml, symbol: str) -> bool:
    return hasattr(ctypes.CDLL(str(fake.library)), symbol)


def raw_list(symbol: str, handle, entry_size: int) -> tuple[int, bytes]:
    """The two-call protocol by hand: (count, the buffer's bytes)."""
    fn = pynvml._nvmlGetFunctionPointer(symbol)
    count = ctypes.c_uint(0)
    assert fn(handle, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    buf = ctypes.create_string_buffer(entry_size * count.value)
    assert fn(handle, ctypes.byref(count), buf) == pynvml.NVML_SUCCESS
    return count.value, buf.raw


@pytest.mark.parametrize("branch", BRANCHES)
def test_each_branch_exports_the_process_lists_its_nvml_h_declares(
    branch: str, nvml_driver: Callable[[str], FakeNvml]
):
    fake = nvml_driver(branch)
    versions, _v3_size, detail, conf = EXPORTS[branch]
    for name in LISTS:
        for version in ("", "_v2", "_v3"):
            symbol = f"nvmlDeviceGet{name}RunningProcesses{version}"
            assert exported(fake, symbol) == (version in versions), symbol
    assert exported(fake, "nvmlDeviceGetRunningProcessDetailList") == detail
    assert exported(fake, "nvmlDeviceGetConfComputeMemSizeInfo") == conf


@pytest.mark.parametrize("branch", BRANCHES)
def test_pids_and_memory_come_through_on_every_branch(
    branch: str, nvml_driver: Callable[[str], FakeNvml]
):
    """Compute, graphics and MPS lists, a GPU outside MIG mode and one in it: every PID with
    its memory, through _v3 where the branch has it and _v2 where not."""
    fake = nvml_driver(branch)
    fake.write(SCENARIO)
    src = fake.source()
    for _ in range(2):
        reading = src.sample([])
        gpus = {g.uuid: g.index for g in reading.gpus}
        got = {(p.pid, p.used_memory, gpus[p.gpu_uuid]) for p in reading.gpu_processes}
        assert got == EXPECTED
    version = "_v3" if "_v3" in EXPORTS[branch][0] else "_v2"
    for name in LISTS:
        assert fake.call_count(f"nvmlDeviceGet{name}RunningProcesses{version}") >= 2


@pytest.mark.parametrize("branch", [b for b in BRANCHES if EXPORTS[b][1]])
def test_the_v3_entry_size_is_chosen_from_the_exports(
    branch: str, nvml_driver: Callable[[str], FakeNvml]
):
    fake = nvml_driver(branch)
    fake.source().sample([])  # binds this build
    assert nvml_processes.v3_layout().size == EXPORTS[branch][1]


def test_32_byte_entries_read_as_24_garble_the_pids(nvml_driver: Callable[[str], FakeNvml]):
    """Why the layout matters: what 535.43.02-535.86.x fill, read with the 24-byte entry every
    other driver uses (and the installed pynvml's c_nvmlProcessInfo_v3_t has), loses every PID
    past the first; read as 32 bytes they are right."""
    fake = nvml_driver("r535.43")
    fake.write(SCENARIO)
    fake.source().sample([])
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    count, raw = raw_list("nvmlDeviceGetComputeRunningProcesses_v3", handle, 32)
    as_32 = [e[0] for e in nvml_processes.ENTRY_32.iter_unpack(raw[: 32 * count])]
    as_24 = [e[0] for e in nvml_processes.ENTRY_24.iter_unpack(raw[: 24 * count])]
    assert as_32 == [4242, 4343, 4444]
    assert as_24[0] == 4242 and as_24[1:] != [4343, 4444]
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle)] != as_32


# branch -> (the export the probe is told is absent, the entry size it then picks)
MISLEADING = {
    "r535.43": ("nvmlDeviceGetConfComputeMemSizeInfo", 24),
    "current": ("nvmlDeviceGetRunningProcessDetailList", 32),
}


@pytest.mark.parametrize("branch", sorted(MISLEADING))
def test_a_wrong_entry_size_is_noticed_and_the_right_one_kept(
    branch: str,
    nvml_driver: Callable[[str], FakeNvml],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
):
    """A driver whose exports mislead the probe (as 535.98's removal of the _v3 lists misled
    nvitop's first one): the first list of several entries is seen to be garbled, read in the
    other size, and that size kept for the library."""
    hidden, wrong = MISLEADING[branch]
    for state in ("_v3_layout", "_confirmed", "_logged"):  # what this test finds stays here
        monkeypatch.setattr(nvml_processes, state, type(getattr(nvml_processes, state))())
    exports = nvml_processes._exports
    monkeypatch.setattr(nvml_processes, "_exports", lambda s: s != hidden and exports(s))
    fake = nvml_driver(branch)
    fake.write(SCENARIO)
    src = fake.source()
    with caplog.at_level(logging.WARNING, logger="otel_gpu.nvml"):
        for _ in range(2):
            reading = src.sample([])
            gpus = {g.uuid: g.index for g in reading.gpus}
            got = {(p.pid, p.used_memory, gpus[p.gpu_uuid]) for p in reading.gpu_processes}
            assert got == EXPECTED
    assert nvml_processes.v3_layout().size == EXPORTS[branch][1]
    assert caplog.text.count(f"entries read as {wrong} bytes are garbled") == 1


def test_entries_garbled_either_way_are_left_out(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    """No layout makes sense of them: the plausible ones are kept, the rest left out, said
    once."""
    monkeypatch.setattr(nvml_processes, "_logged", set())
    good = nvml_processes.ENTRY_24.pack(4242, 1 << 30, 0xFFFFFFFF, 0xFFFFFFFF)
    bad = nvml_processes.ENTRY_24.pack(0, 1 << 30, 0xFFFFFFFF, 0xFFFFFFFF)
    huge = nvml_processes.ENTRY_24.pack(1 << 23, 1 << 30, 0xFFFFFFFF, 0xFFFFFFFF)
    raw = good + bad + huge + good
    with caplog.at_level(logging.WARNING, logger="otel_gpu.nvml"):
        kept = nvml_processes.decode(raw, 4, nvml_processes.ENTRY_24, "nvmlDeviceGetX_v2")
    assert [e[0] for e in kept] == [4242, 4242]
    assert "2 of 4 process entries garbled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="otel_gpu.nvml"):
        again = nvml_processes.decode(raw, 4, nvml_processes.ENTRY_24, "nvmlDeviceGetX_v2")
    assert again == kept and "garbled" not in caplog.text  # said once


@pytest.mark.parametrize("branch", [b for b in BRANCHES if EXPORTS[b][2]])
def test_the_process_detail_list_carries_cc_memory(
    branch: str, nvml_driver: Callable[[str], FakeNvml]
):
    """nvmlDeviceGetRunningProcessDetailList (535.104.05 on) through pynvml: its 32-byte
    entries, with the CC protected memory; the agent reads the _v3 lists, not this."""
    fake = nvml_driver(branch)
    # no "na" memory: pynvml's reader of this list fails on one (it sets a ctypes field to None)
    fake.write("devices = 1\ngpu.0.processes = 4242:1073741824:536870912 4444:2147483648:4096")
    fake.source().sample([])
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    listed = pynvml.nvmlDeviceGetRunningProcessDetailList(
        handle, pynvml.nvmlProcessDetailList_v1, pynvml.NVML_PROCESS_MODE_COMPUTE
    )
    procs = [(p.pid, p.usedGpuMemory, p.usedGpuCcProtectedMemory) for p in listed]
    assert procs == [(4242, 1073741824, 536870912), (4444, 2147483648, 4096)]


@pytest.mark.parametrize("branch", BRANCHES)
def test_the_unversioned_lists_fill_16_byte_entries(
    branch: str, nvml_driver: Callable[[str], FakeNvml]
):
    fake = nvml_driver(branch)
    fake.write(SCENARIO)
    fake.source().sample([])
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    count, raw = raw_list("nvmlDeviceGetMPSComputeRunningProcesses", handle, 16)
    assert count == 2
    pids = [int.from_bytes(raw[i * 16 : i * 16 + 4], "little") for i in range(count)]
    used = [int.from_bytes(raw[i * 16 + 8 : i * 16 + 16], "little") for i in range(count)]
    assert (pids, used) == ([4646, 4747], [4096, 8192])


def test_a_bad_cc_memory_is_rejected(fake_nvml: FakeNvml):
    fake_nvml.write("gpu.0.processes = 4242:1024:na 4343:1024:2048")  # both forms parse
    with pytest.raises(ValueError, match="cannot parse"):
        fake_nvml.write("gpu.0.processes = 4242:1024:lots")
