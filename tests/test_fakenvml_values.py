"""The C fake's scenario keys for odd values and hot-plug, through the real pynvml: escaped
bytes in strings, strings longer than NVML's buffers, memory used above total, skewed process
utilization stamps, and a device count that changes while NVML stays initialized."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pynvml
import pytest
from fakenvml.fixtures import FakeNvml

from otel_gpu.sampling import nvml_api

pytestmark = pytest.mark.unit


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
    try:
        fn(*args)
    except pynvml.NVMLError as err:
        return err.value
    return pynvml.NVML_SUCCESS


def raw_name(index: int) -> bytes:
    return nvml_api.device_string("nvmlDeviceGetName", pynvml.nvmlDeviceGetHandleByIndex(index))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (r"gpu.0.name = A\x42C", b"ABC"),
        (r"gpu.0.name = \xff\xfeX", b"\xff\xfeX"),  # not UTF-8
        (r"gpu.0.name = back\\slash", b"back\\slash"),
        ("gpu.0.name = ", b""),
        (r"gpu.0.uuid = GPU-\xc3\x28", b"GPU-\xc3\x28"),
    ],
)
def test_string_fields_take_escaped_bytes(nvml: FakeNvml, line: str, expected: bytes):
    nvml.write(f"devices = 1\n{line}")
    field = "nvmlDeviceGetUUID" if ".uuid" in line else "nvmlDeviceGetName"
    got = nvml_api.device_string(field, pynvml.nvmlDeviceGetHandleByIndex(0))
    assert got == expected


@pytest.mark.parametrize("bad", [r"\q", r"\x0", r"\x00", r"\xzz", "\\"])
def test_bad_escapes_are_rejected(fake_nvml: FakeNvml, bad: str):
    with pytest.raises(ValueError, match="cannot parse"):
        fake_nvml.write(f"devices = 1\ngpu.0.name = bad{bad}name")


def test_a_name_longer_than_nvmls_buffer_is_insufficient_size(nvml: FakeNvml):
    nvml.write("devices = 1\ngpu.0.name = " + "N" * 95 + "\ngpu.0.uuid = " + "U" * 96)
    assert raw_name(0) == b"N" * 95  # fits NVML's 96 bytes with its terminator
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert code_of(nvml_api.device_string, "nvmlDeviceGetUUID", handle) == 7  # INSUFFICIENT_SIZE


def test_memory_used_may_exceed_total_with_free_zero(nvml: FakeNvml):
    nvml.write(
        "devices = 1\ngpu.0.memory.total = 1000\ngpu.0.memory.used = 1500\ngpu.0.memory.reserved = 100"
    )
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    assert (v1.total, v1.used, v1.free) == (1000, 1500, 0)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    assert (v2.total, v2.reserved, v2.used, v2.free) == (1000, 100, 1400, 0)


def test_process_utilization_stamps_can_be_skewed(nvml: FakeNvml):
    nvml.write("devices = 1\ngpu.0.process_util = 42:50:20\ngpu.0.process_util.offset_ms = 3600000")
    (sample,) = pynvml.nvmlDeviceGetProcessUtilization(pynvml.nvmlDeviceGetHandleByIndex(0), 0)
    ahead_s = sample.timeStamp / 1e6 - time.time()
    assert 3590 < ahead_s < 3610


def test_device_count_follows_the_scenario_without_a_new_init(nvml: FakeNvml):
    nvml.write("devices = 3\ngpu.2.name = Added")
    assert pynvml.nvmlDeviceGetCount() == 3
    assert raw_name(2) == b"Added"
    nvml.write("devices = 1")  # GPUs 1 and 2 removed
    assert pynvml.nvmlDeviceGetCount() == 1
    assert code_of(pynvml.nvmlDeviceGetHandleByIndex, 1) == pynvml.NVML_ERROR_INVALID_ARGUMENT
