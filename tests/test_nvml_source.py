"""NvmlSource through the real pynvml and the C fake of libnvidia-ml.so.1 (tests/fakenvml)."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import time

import pynvml
import pytest
from fakenvml.build import check_abi
from fakenvml.fixtures import BUILD_DIR, FakeNvml

from otel_gpu.sampling import nvml_processes
from otel_gpu.sampling.snapshot import STATUS_DEGRADED, STATUS_FAILED, STATUS_OK
from otel_gpu.sampling.visible_devices import select_visible

UUID = "GPU-fa4e0000-0000-4000-8000-{:012x}"


class ManualClock:
    """Drives NvmlSource's retry schedules and slow metrics."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def by_index(reading):
    return {g.index: g for g in reading.gpus}


# ---- the fake itself -------------------------------------------------------------------------


@pytest.mark.process  # runs the C compiler
def test_fake_compiles_against_nvidia_nvml_h():
    result = check_abi(BUILD_DIR)
    if not result.ran:
        pytest.skip(result.detail)  # reported as not run, never as passed
    assert result.ok, result.detail


@pytest.mark.unit
def test_pynvml_structs_match_the_fakes_pinned_layouts():
    # The same numbers are static asserts in fakenvml.c (and, via check_abi, in nvml.h).
    assert ctypes.sizeof(pynvml.c_nvmlMemory_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) == 40
    assert pynvml.nvmlMemory_v2 == 0x02000028
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert pynvml.c_nvmlProcessInfo_v3_t.usedGpuMemory.offset == 8
    assert nvml_processes.PROCESS_INFO.size == 24  # NvmlSource decodes process entries itself
    assert ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t) == 32
    assert ctypes.sizeof(pynvml.c_nvmlEventData_t) == 32
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == 68
    assert ctypes.sizeof(pynvml.c_nvmlTemperature_v1_t) == 12


@pytest.mark.unit
def test_fake_rejects_a_bad_scenario_line(fake_nvml: FakeNvml):
    with pytest.raises(ValueError, match="cannot parse"):
        fake_nvml.write("gpu.0.power.usage = lots")


@pytest.mark.process
def test_child_process_loads_the_fake_by_name(fake_nvml: FakeNvml):
    fake_nvml.write("devices = 3\ngpu.2.name = Fake A100")
    printed = fake_nvml.run_python(
        """
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(2)
        print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetName(h))
        pynvml.nvmlShutdown()
        """
    )
    assert printed == ["3", "Fake", "A100"]
    assert fake_nvml.child_stats()[("nvmlDeviceGetHandleByIndex_v2", 2)] == 1


# ---- values and units ------------------------------------------------------------------------


@pytest.mark.unit
def test_every_field_with_units_converted(fake_nvml: FakeNvml):
    fake_nvml.write(
        """
        devices = 2
        driver_version = 560.35.03
        cuda_driver_version = 12060
        gpu.*.memory.total = 85899345920
        gpu.0.name = NVIDIA A100-SXM4-80GB
        gpu.0.memory.used = 10000000000
        gpu.0.memory.reserved = 500000000
        gpu.0.util.gpu = 87
        gpu.0.util.memory = 41
        gpu.0.util.encoder = 12
        gpu.0.util.decoder = 7
        gpu.0.temperature = 66
        gpu.0.power.usage = 312500
        gpu.0.power.limit = 400000
        gpu.0.energy = 5000000+300000/s
        gpu.0.clock.graphics = 1410
        gpu.0.clock.sm = 1395
        gpu.0.clock.mem = 1593
        gpu.0.pcie.tx = 2048
        gpu.0.pcie.rx = 1000
        gpu.0.ecc.corrected = 3
        gpu.0.ecc.uncorrected = 1
        gpu.0.mig = 1
        gpu.0.clocks_event_reasons = 0x24
        gpu.1.util.gpu = steps 0:10 0.4:90
        gpu.1.util.memory = 41
        """
    )
    src = fake_nvml.source()
    reading = src.sample([])
    elapsed = time.time() - fake_nvml.t0
    assert reading.no_gpu_reason is None
    g = by_index(reading)[0]
    assert (g.uuid, g.name, g.status) == (UUID.format(0), "NVIDIA A100-SXM4-80GB", STATUS_OK)
    assert g.memory_total == 85899345920
    assert g.memory_used == 10000000000  # NVML "used": includes the reserved part
    assert g.memory_reserved == 500000000
    assert (g.util_gpu, g.util_memory) == (None, None)  # GPU 0 is in MIG mode: NVML has none
    assert by_index(reading)[1].util_memory == 0.41
    assert (g.util_encoder, g.util_decoder) == (0.12, 0.07)
    assert g.temperature_c == 66.0
    assert (g.power_w, g.power_limit_w) == (312.5, 400.0)
    assert 5000 + 300 * (elapsed - 1) <= g.energy_j <= 5000 + 300 * (elapsed + 1)  # mJ -> J
    assert (g.clock_sm_hz, g.clock_mem_hz) == (1395e6, 1593e6)
    assert (g.pcie_tx_bytes_per_s, g.pcie_rx_bytes_per_s) == (2048 * 1024, 1000 * 1024)
    assert (g.ecc_corrected, g.ecc_uncorrected) == (3, 1)
    assert g.mig_mode is True
    assert g.throttle_reasons == 0x24
    assert g.xid_errors == 0
    assert src.host_info().driver_version == "560.35.03"
    assert src.host_info().cuda_driver_version == "12.6"
    assert src.host_info().gpu_count == 2
    assert src.host_info().gpu_models == ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")
    # steps: 10 % until 0.4 s after t0, then 90 %
    assert by_index(reading)[1].util_gpu == (0.1 if elapsed < 0.4 else 0.9)
    time.sleep(max(0.0, 0.45 - (time.time() - fake_nvml.t0)))
    assert by_index(src.sample([]))[1].util_gpu == 0.9


@pytest.mark.unit
def test_memory_info_v1_fallback_and_deprecated_temperature(fake_nvml: FakeNvml):
    fake_nvml.write(
        """
        devices = 1
        gpu.0.memory.used = 3000
        gpu.0.temperature = 51
        fail.nvmlDeviceGetMemoryInfo_v2 = NOT_SUPPORTED
        fail.nvmlDeviceGetTemperatureV = FUNCTION_NOT_FOUND
        """
    )
    src = fake_nvml.source()
    for _ in range(3):
        g = src.sample([]).gpus[0]
        assert (g.memory_used, g.memory_reserved, g.temperature_c) == (3000, None, 51.0)
    assert fake_nvml.call_count("nvmlDeviceGetMemoryInfo_v2") == 1
    assert fake_nvml.call_count("nvmlDeviceGetTemperatureV") == 1
    assert fake_nvml.call_count("nvmlDeviceGetMemoryInfo") == 3  # v1 from the first sweep on
    assert fake_nvml.call_count("nvmlDeviceGetTemperature") == 3


# ---- failures --------------------------------------------------------------------------------


@pytest.mark.unit
def test_gpu_lost_mid_run_while_the_other_keeps_reporting(fake_nvml: FakeNvml, caplog):
    clock = ManualClock()
    src = fake_nvml.source(clock=clock, lost_retry_s=30)
    assert [g.status for g in src.sample([]).gpus] == [STATUS_OK, STATUS_OK]
    calls_before = fake_nvml.call_count("*", gpu=1)
    fake_nvml.append("fail.*.1 = GPU_IS_LOST")
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    for _ in range(4):
        gpus = by_index(src.sample([]))
        assert gpus[0].status == STATUS_OK and gpus[0].power_w == 70.0
        assert gpus[1].status == STATUS_FAILED and gpus[1].power_w is None
        assert gpus[1].uuid == UUID.format(1)
    # After the loss the lost GPU is not called again until its probe is due.
    assert fake_nvml.call_count("*", gpu=1) == calls_before + 1  # the one call that failed
    assert sum("is lost" in r.getMessage() for r in caplog.records) == 1
    fake_nvml.write("devices = 2")  # the GPU is back (after a reset)
    assert by_index(src.sample([]))[1].status == STATUS_FAILED  # no probe yet
    clock.now += 31
    gpus = by_index(src.sample([]))
    assert gpus[1].status == STATUS_OK and gpus[1].power_w == 70.0


@pytest.mark.unit
def test_identity_is_read_once_per_gpu_and_a_missing_one_is_unknown(fake_nvml: FakeNvml, caplog):
    """hw.serial_number, hw.firmware_version (VBIOS), hw.driver_version and the temperature
    thresholds (hw.temperature.limit): read when a GPU is first seen, never again; a board
    without a serial (NOT_SUPPORTED) has none, silently; a MIG device has its GPU's."""
    fake_nvml.write(
        """
        devices = 2
        driver_version = 535.161.08
        gpu.0.serial = 1654321098765
        gpu.0.vbios = 92.00.45.00.06
        gpu.0.temperature.slowdown = 85
        gpu.0.temperature.shutdown = 90
        gpu.0.mig = 1
        mig.0.0.name = NVIDIA H100 80GB HBM3 MIG 3g.40gb
        fail.nvmlDeviceGetSerial.1 = NOT_SUPPORTED
        """
    )
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    src = fake_nvml.source()
    for _ in range(4):
        reading = src.sample([])
    gpu0, gpu1 = (g for g in reading.gpus if g.parent is None)
    (mig,) = [g for g in reading.gpus if g.parent is not None]
    assert (gpu0.serial, gpu0.firmware_version, gpu0.driver_version) == (
        "1654321098765",
        "92.00.45.00.06",
        "535.161.08",
    )
    assert (gpu0.temperature_slowdown_c, gpu0.temperature_shutdown_c) == (85.0, 90.0)
    assert (gpu1.serial, gpu1.firmware_version) == (None, "96.00.99.00.01")
    assert (gpu1.temperature_slowdown_c, gpu1.temperature_shutdown_c) == (89.0, 92.0)
    assert (mig.serial, mig.firmware_version) == (gpu0.serial, gpu0.firmware_version)
    for symbol in ("nvmlDeviceGetSerial", "nvmlDeviceGetVbiosVersion"):
        assert fake_nvml.call_count(symbol, gpu=0) == 1 and fake_nvml.call_count(symbol, gpu=1) == 1
    assert fake_nvml.call_count("nvmlDeviceGetTemperatureThreshold", gpu=0) == 2
    assert not [r for r in caplog.records if "serial" in r.getMessage()]


@pytest.mark.unit
def test_not_supported_metric_is_never_asked_again(fake_nvml: FakeNvml, caplog):
    fake_nvml.append("fail.nvmlDeviceGetPowerUsage.0 = NOT_SUPPORTED")
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    src = fake_nvml.source()
    for _ in range(5):
        gpus = by_index(src.sample([]))
        assert gpus[0].power_w is None and gpus[0].power_limit_w == 700.0
        assert gpus[1].power_w == 70.0
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=0) == 1
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=1) == 5
    assert sum("power not available" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.unit
def test_slow_metrics_are_read_once_per_period_and_reported_in_between(fake_nvml: FakeNvml):
    fake_nvml.append(
        """
        gpu.*.pcie.tx = 4
        gpu.*.ecc.uncorrected = steps 0:0 0.5:2
        fail.nvmlDeviceGetEnforcedPowerLimit.1 = TIMEOUT until=1
        """
    )
    clock = ManualClock()
    src = fake_nvml.source(clock=clock, slow_period_s=10.0)
    first = by_index(src.sample([]))
    assert first[0].pcie_tx_bytes_per_s == 4096 and first[0].power_limit_w == 700.0
    assert first[1].power_limit_w is None  # failed this read: unknown until the next one
    time.sleep(0.6)  # the fake's ECC count steps to 2
    for _ in range(3):
        clock.now += 3.0
        gpus = by_index(src.sample([]))
        # last read values, not re-read: the ECC step is not seen yet
        assert (gpus[0].pcie_tx_bytes_per_s, gpus[0].ecc_uncorrected) == (4096, 0)
        assert gpus[1].power_limit_w is None and gpus[0].power_w == 70.0
    assert fake_nvml.call_count("nvmlDeviceGetPcieThroughput", gpu=0) == 2  # tx + rx, once
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=0) == 4  # fast: every sweep
    clock.now += 1.0  # 10 s after the first read
    gpus = by_index(src.sample([]))
    assert gpus[0].ecc_uncorrected == 2 and gpus[1].power_limit_w == 700.0
    assert fake_nvml.call_count("nvmlDeviceGetPcieThroughput", gpu=0) == 4


@pytest.mark.unit
def test_video_engines_are_read_every_sweep_only_while_busy(fake_nvml: FakeNvml):
    """Encoder/decoder utilization, idle in training: read with the slow metrics while idle
    (reported as the last read in between), every sweep once busy, slow again when idle."""
    fake_nvml.append("gpu.0.util.encoder = steps 0:0 1:40 2:0")
    clock = ManualClock()
    src = fake_nvml.source(clock=clock, slow_period_s=10.0)
    assert by_index(src.sample([]))[0].util_encoder == 0.0
    clock.now += 1.0
    assert by_index(src.sample([]))[0].util_encoder == 0.0  # not read: the last value
    assert fake_nvml.call_count("nvmlDeviceGetEncoderUtilization", gpu=0) == 1
    time.sleep(max(0.0, 1.05 - (time.time() - fake_nvml.t0)))  # the encoder gets busy
    clock.now += 1.0
    assert by_index(src.sample([]))[0].util_encoder == 0.0  # not due yet
    clock.now += 8.0
    assert by_index(src.sample([]))[0].util_encoder == 0.4  # the slow read sees it busy
    clock.now += 1.0
    assert by_index(src.sample([]))[0].util_encoder == 0.4
    assert fake_nvml.call_count("nvmlDeviceGetEncoderUtilization", gpu=0) == 3  # every sweep
    time.sleep(max(0.0, 2.05 - (time.time() - fake_nvml.t0)))  # idle again
    clock.now += 1.0
    assert by_index(src.sample([]))[0].util_encoder == 0.0
    clock.now += 1.0
    src.sample([])
    assert fake_nvml.call_count("nvmlDeviceGetEncoderUtilization", gpu=0) == 4  # slow again


@pytest.mark.unit
def test_intermittent_timeout_is_unknown_for_that_sweep_and_logged_once(fake_nvml, caplog):
    fake_nvml.append("fail.nvmlDeviceGetUtilizationRates.0 = TIMEOUT after=1 until=4")
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    src = fake_nvml.source()
    utils = [by_index(src.sample([]))[0].util_gpu for _ in range(6)]
    assert utils == [0.0, None, None, None, 0.0, 0.0]  # unknown, never a made-up 0
    assert fake_nvml.call_count("nvmlDeviceGetUtilizationRates", gpu=0) == 6  # still asked
    messages = [r.getMessage() for r in caplog.records]
    assert sum("utilization failed (TIMEOUT)" in m for m in messages) == 1
    assert sum("utilization: readable again" in m for m in messages) == 1


@pytest.mark.unit
def test_hung_call_bounds_the_sweep_and_never_piles_up(fake_nvml: FakeNvml):
    # The 2nd temperature read on GPU 1 hangs for 1.5 s; the deadline is 0.3 s.
    fake_nvml.append("delay.nvmlDeviceGetTemperatureV.1 = 1500 after=1 until=2")
    src = fake_nvml.source(call_timeout_s=0.3, sweep_timeout_s=0.6)
    assert by_index(src.sample([]))[1].temperature_c == 35.0
    began = time.monotonic()
    gpus = by_index(src.sample([]))
    assert time.monotonic() - began < 0.9
    assert gpus[0].status == STATUS_OK and gpus[0].power_w == 70.0  # read before the hang
    assert gpus[1].status == STATUS_DEGRADED and gpus[1].temperature_c is None
    calls = fake_nvml.call_count()
    began = time.monotonic()
    gpus = by_index(src.sample([]))  # NVML thread still stuck: answer at once, call nothing
    assert time.monotonic() - began < 0.15
    assert fake_nvml.call_count() == calls
    assert gpus[1].status == STATUS_DEGRADED and gpus[0].power_w is None
    time.sleep(1.6)  # the hung call returns; the abandoned sweep makes no further calls
    assert fake_nvml.call_count() == calls
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=1) == 1
    gpus = by_index(src.sample([]))
    assert [gpus[i].status for i in (0, 1)] == [STATUS_OK, STATUS_OK]
    assert gpus[1].temperature_c == 35.0 and gpus[1].power_w == 70.0


@pytest.mark.unit
def test_hung_init_reports_no_gpu_without_waiting(fake_nvml: FakeNvml):
    clock = ManualClock()
    fake_nvml.append("delay.nvmlInitWithFlags = 1000 until=1")
    src = fake_nvml.source(call_timeout_s=0.3, clock=clock)
    began = time.monotonic()
    reading = src.sample([])
    assert time.monotonic() - began < 0.9
    assert reading.no_gpu_reason == "NVML initialization did not return within 0.3 s"
    clock.now += 1
    began = time.monotonic()
    assert src.sample([]).no_gpu_reason == "NVML initialization is not responding"
    assert time.monotonic() - began < 0.15
    assert fake_nvml.call_count("nvmlInitWithFlags") == 1  # no second init behind the first
    time.sleep(1.0)  # the hung init returns; its abandoned job stops there
    clock.now += 2
    reading = src.sample([])
    assert reading.no_gpu_reason is None and len(reading.gpus) == 2


@pytest.mark.unit
def test_no_library_then_it_appears(fake_nvml: FakeNvml, tmp_path):
    clock = ManualClock()
    path = tmp_path / "driver" / "libnvidia-ml.so.1"
    src = fake_nvml.source(library_path=str(path), clock=clock)  # overrides the fixture's path
    reading = src.sample([])
    assert reading.gpus == () and "cannot load NVML library" in reading.no_gpu_reason
    assert src.host_info().gpu_count is None
    path.parent.mkdir()
    path.symlink_to(fake_nvml.library)
    clock.now += 0.5
    assert src.sample([]).no_gpu_reason is not None  # backoff: next try 1 s after the failure
    clock.now += 0.5
    reading = src.sample([])
    assert reading.no_gpu_reason is None and len(reading.gpus) == 2


@pytest.mark.process
def test_library_missing_from_the_loader_path(tmp_path):
    # A child process: in this one pynvml may already hold the fake from earlier tests.
    code = (
        "from otel_gpu.sampling.nvml import NvmlSource\n"
        "src = NvmlSource()\n"
        "print(src.sample([]).no_gpu_reason)\n"
        "print(src.host_info().gpu_count)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "NVML library libnvidia-ml.so.1 not found "
        "(no NVIDIA driver installed, or set OTEL_GPU_NVML_LIBRARY)",
        "None",
    ]


@pytest.mark.unit
def test_driver_not_loaded_retries_with_backoff_then_recovers(fake_nvml: FakeNvml):
    clock = ManualClock()
    fake_nvml.write("devices = 1\nfail.nvmlInitWithFlags = DRIVER_NOT_LOADED")
    src = fake_nvml.source(clock=clock, retry_initial_s=1, retry_max_s=4)
    attempts = []
    for _ in range(12):  # 12 s of sweeps, one per second
        reading = src.sample([])
        assert reading.no_gpu_reason == "NVIDIA driver not loaded" and reading.gpus == ()
        attempts.append(fake_nvml.call_count("nvmlInitWithFlags"))
        clock.now += 1
    # tries at t = 0, 1, 3, 7, 11: delays 1, 2, 4, 4 (capped)
    assert attempts == [1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5]
    fake_nvml.write("devices = 1")  # driver loaded
    clock.now += 4
    assert src.sample([]).gpus[0].power_w == 70.0
    # the driver goes away mid-run: no-GPU mode, then back with a fresh init
    fake_nvml.append("fail.* = DRIVER_NOT_LOADED")
    assert src.sample([]).no_gpu_reason == "NVIDIA driver not loaded"
    fake_nvml.write("devices = 1")
    clock.now += 1
    assert src.sample([]).gpus[0].status == STATUS_OK


# ---- selection, processes, events ------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, [0, 1, 2, 3, 4, 5]),
        ("2,0", [2, 0]),
        ("", []),
        ("1,7,2", [1]),  # CUDA stops at the first entry that names no GPU
        ("GPU-abc", [3]),  # unique UUID prefix
        ("GPU-fa4e0000", []),  # ambiguous prefix
        ("MIG-1234-5678,1", [1]),  # names no MIG device: skipped, the list goes on
        ("MIG-GPU-abcdef12/1/0,1", [1]),  # legacy form: skipped
        (f"{UUID.format(1)},0,0", [1, 0]),
        ("MIG-0000aaaa-0001,0", [5, 0]),  # a MIG device by unique prefix, after the 4 GPUs
        ("mig-0000AAAA", []),  # ambiguous MIG prefix: skipped
    ],
)
def test_select_visible(spec, expected):
    uuids = [UUID.format(i) for i in range(3)] + ["GPU-abcdef12-0000-4000-8000-000000000000"]
    migs = [f"MIG-0000aaaa-{i:04x}-4000-8000-000000000000" for i in range(2)]
    assert select_visible(spec, uuids, migs)[0] == expected
    if spec is None:  # everything, MIG devices included
        assert select_visible(spec, uuids, migs)[0] == [0, 1, 2, 3, 4, 5]


@pytest.mark.unit
def test_cuda_visible_devices_selects_the_jobs_gpus(fake_nvml: FakeNvml):
    fake_nvml.write("devices = 4\ngpu.3.uuid = GPU-abcdef12-0000-4000-8000-000000000000")
    reading = fake_nvml.source(visible_devices="GPU-abc,1").sample([])
    assert [(g.index, g.uuid) for g in reading.gpus] == [
        (3, "GPU-abcdef12-0000-4000-8000-000000000000"),
        (1, UUID.format(1)),
    ]
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=0) == 0
    none = fake_nvml.source(visible_devices="").sample([])
    assert none.gpus == () and "CUDA_VISIBLE_DEVICES" in none.no_gpu_reason


@pytest.mark.unit
def test_process_list_two_call_protocol_with_unavailable_memory(fake_nvml: FakeNvml):
    fake_nvml.write(
        """
        devices = 2
        gpu.0.processes = 4242:1073741824 4343:na 4444:1000+1000/s
        """
    )
    src = fake_nvml.source()
    procs = src.sample([]).gpu_processes
    assert [(p.pid, p.gpu_uuid) for p in procs] == [(4242, UUID.format(0))] + [
        (pid, UUID.format(0)) for pid in (4343, 4444)
    ]
    assert procs[0].used_memory == 1073741824
    assert procs[1].used_memory is None  # 2^64-1: "not available", never 0
    assert procs[2].used_memory >= 1000
    # probe (INSUFFICIENT_SIZE) + fill on GPU 0; GPU 1 answers the probe with "none"
    assert fake_nvml.call_count("nvmlDeviceGetComputeRunningProcesses_v3", gpu=0) == 2
    assert fake_nvml.call_count("nvmlDeviceGetComputeRunningProcesses_v3", gpu=1) == 1


@pytest.mark.unit
def test_graphics_and_mps_client_processes_join_the_compute_list(fake_nvml: FakeNvml):
    """Under MPS the compute list shows the MPS server and the clients are in the MPS list; a
    process in two lists ("C+G") is one process holding its memory once. Lists that were empty
    are asked again only with the slow metrics."""
    fake_nvml.write(
        """
        devices = 2
        gpu.0.processes = 100:500 200:1000
        gpu.0.graphics_processes = 200:1000 300:64
        gpu.0.mps_processes = 400:2048
        """
    )
    clock = ManualClock()
    src = fake_nvml.source(clock=clock, slow_period_s=10.0)
    procs = src.sample([]).gpu_processes
    assert sorted((p.pid, p.used_memory) for p in procs if p.gpu_uuid == UUID.format(0)) == [
        (100, 500),
        (200, 1000),
        (300, 64),
        (400, 2048),
    ]
    assert [p for p in procs if p.gpu_uuid == UUID.format(1)] == []
    for _ in range(3):  # GPU 0's lists are in use: read every sweep; GPU 1's are not
        clock.now += 1.0
        assert {p.pid for p in src.sample([]).gpu_processes} == {100, 200, 300, 400}
    assert fake_nvml.call_count("nvmlDeviceGetMPSComputeRunningProcesses_v3", gpu=0) == 8
    assert fake_nvml.call_count("nvmlDeviceGetMPSComputeRunningProcesses_v3", gpu=1) == 1
    assert fake_nvml.call_count("nvmlDeviceGetGraphicsRunningProcesses_v3", gpu=1) == 1
    fake_nvml.append("gpu.1.mps_processes = 500:4096")
    clock.now += 1.0
    assert 500 not in {p.pid for p in src.sample([]).gpu_processes}  # not asked until due
    clock.now += 9.0
    assert 500 in {p.pid for p in src.sample([]).gpu_processes}


@pytest.mark.unit
def test_process_utilization_not_found_and_last_seen_timestamp(fake_nvml: FakeNvml, caplog):
    fake_nvml.write(
        """
        devices = 1
        gpu.0.processes = 4242:1000 4343:2000
        gpu.0.process_util = 4242:50:20
        gpu.0.process_util.period_ms = 3600000
        """
    )
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    src = fake_nvml.source(process_util_hold_s=0)
    p1, p2 = src.sample([]).gpu_processes
    assert (p1.sm_util, p1.mem_util) == (0.5, 0.2)
    assert (p2.sm_util, p2.mem_util) == (None, None)  # no samples for it
    assert fake_nvml.call_count("nvmlDeviceGetProcessUtilization") == 2  # probe + fill
    # The same sample period again: the last-seen timestamp makes NVML answer NOT_FOUND.
    p1, _ = src.sample([]).gpu_processes
    assert p1.sm_util is None
    assert fake_nvml.call_count("nvmlDeviceGetProcessUtilization") == 3
    assert not [r for r in caplog.records if "process_util" in r.getMessage()]
    held = fake_nvml.source(process_util_hold_s=60)
    held.sample([])
    assert held.sample([]).gpu_processes[0].sm_util == 0.5  # held across NOT_FOUND


@pytest.mark.unit
def test_xid_events_are_counted_per_gpu(fake_nvml: FakeNvml):
    fake_nvml.write(
        """
        devices = 3
        gpu.1.xid = 79 13
        gpu.2.supported_events = 0
        """
    )
    src = fake_nvml.source()
    gpus = by_index(src.sample([]))
    assert (gpus[0].xid_errors, gpus[1].xid_errors) == (0, 2)
    assert gpus[2].xid_errors is None  # Xid events not supported there: unknown, not 0
    fake_nvml.append("gpu.1.xid = 79 13 48")  # one more event arrives
    assert by_index(src.sample([]))[1].xid_errors == 3
    assert by_index(src.sample([]))[1].xid_errors == 3


@pytest.mark.unit
def test_close_shuts_nvml_down(fake_nvml: FakeNvml):
    src = fake_nvml.source()
    assert src.sample([]).gpus
    src.close()
    assert fake_nvml.call_count("nvmlShutdown") == 1
    assert fake_nvml.call_count("nvmlEventSetFree") == 1
    assert src.sample([]).no_gpu_reason == "NVML source closed"


@pytest.mark.unit
def test_sweep_of_8_gpus_with_64_processes_each_is_cheap(fake_nvml: FakeNvml):
    pids = " ".join(f"{10000 + i}:{(i + 1) << 20}" for i in range(64))
    utils = " ".join(f"{10000 + i}:{i % 100}:{i % 50}" for i in range(64))
    fake_nvml.write(f"devices = 8\ngpu.*.processes = {pids}\ngpu.*.process_util = {utils}")
    src = fake_nvml.source()
    reading = src.sample([])
    assert len(reading.gpus) == 8 and len(reading.gpu_processes) == 8 * 64
    began = time.process_time()
    for _ in range(20):
        src.sample([])
    per_sweep = (time.process_time() - began) / 20
    # Typically ~3 ms here; the bound only catches gross regressions on a busy machine.
    assert per_sweep < 0.05, per_sweep
    assert os.environ["FAKE_NVML_SCENARIO"] == str(fake_nvml.scenario_path)


@pytest.mark.unit
def test_mig_devices_report_memory_and_processes_under_their_own_uuids(fake_nvml: FakeNvml):
    """A GPU in MIG mode: the GPU keeps its physical metrics, each MIG device reports memory
    and its processes under its MIG UUID with the GPU as hw.parent, no process is counted twice
    (the GPU's aggregate list is not read), and nothing NVML lacks for MIG devices is asked."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_gpu.agent import instruments as metrics

    mig0 = "MIG-00000000-0000-4000-8000-000000000000"
    mig2 = "MIG-00000000-0002-4000-8000-000000000000"
    fake_nvml.write(
        """
        devices = 2
        gpu.0.name = NVIDIA A100-SXM4-80GB
        gpu.0.mig = 1
        mig.0.0.memory.total = 42949672960
        mig.0.0.memory.used = 1000000000
        mig.0.0.processes = 4242:1000
        mig.0.2.name = NVIDIA A100-SXM4-80GB MIG 3g.40gb
        mig.0.2.processes = 4343:2000
        gpu.1.processes = 5000:64
        """
    )
    src = fake_nvml.source()
    reading = src.sample([])
    gpus = {g.uuid: g for g in reading.gpus}
    assert list(gpus) == [UUID.format(0), mig0, mig2, UUID.format(1)]
    gpu0, m0 = gpus[UUID.format(0)], gpus[mig0]
    assert (m0.parent, m0.index, m0.status) == (UUID.format(0), 0, STATUS_OK)
    assert (m0.memory_total, m0.memory_used) == (42949672960, 1000000000)
    assert m0.util_gpu is None and m0.power_w is None and m0.temperature_c is None
    assert gpus[mig2].name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert gpu0.parent is None and gpu0.power_w == 70.0  # physical metrics stay on the GPU
    assert gpu0.util_gpu is None  # NVML has no utilization in MIG mode
    assert gpu0.processes_listed is False and m0.processes_listed is True
    procs = sorted((p.pid, p.gpu_uuid, p.used_memory) for p in reading.gpu_processes)
    assert procs == [(4242, mig0, 1000), (4343, mig2, 2000), (5000, UUID.format(1), 64)]
    src.sample([])
    # Asked of the GPU only: MIG devices are never asked what NVML does not have for them.
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=0) == 2
    assert fake_nvml.call_count("nvmlDeviceGetTemperatureV", gpu=0) == 2

    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: _snap(src))
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        (m.name, p.attributes["hw.id"]): p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
        if "hw.id" in p.attributes
    }
    usage = points[("hw.gpu.memory.usage", mig0)]
    assert usage.value == 1000000000 and usage.attributes["hw.parent"] == UUID.format(0)
    assert "hw.parent" not in points[("hw.gpu.memory.usage", UUID.format(0))].attributes
    assert points[("process.gpu.memory.usage", mig2)].attributes["process.pid"] == 4343
    assert ("hw.gpu.utilization", mig0) not in points

    # A pod given one MIG device watches that device only.
    only = fake_nvml.source(visible_devices=mig2[:18]).sample([])
    assert [g.uuid for g in only.gpus] == [mig2]
    assert [p.pid for p in only.gpu_processes] == [4343]


def _snap(src):
    from otel_gpu.sampling.snapshot import Snapshot

    reading = src.sample([])
    return Snapshot(time=time.time(), gpus=reading.gpus, gpu_processes=reading.gpu_processes)


@pytest.mark.unit
def test_mig_reconfiguration_is_followed_without_a_restart(fake_nvml: FakeNvml, caplog):
    """MIG turned on (seen with the slow metrics), a MIG device destroyed (its calls answer
    NOT_FOUND), MIG turned off again: the device list follows, and the GPU keeps its state."""
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    mig0 = "MIG-00000000-0000-4000-8000-000000000000"
    mig1 = "MIG-00000000-0001-4000-8000-000000000000"
    fake_nvml.write(
        """
        devices = 1
        gpu.0.processes = 100:500
        mig.0.0.processes = 4242:1000
        mig.0.1.memory.used = 7
        """
    )
    clock = ManualClock()
    src = fake_nvml.source(clock=clock, slow_period_s=10.0)

    def uuids():
        clock.now += 10.0  # every sweep is a slow one
        reading = src.sample([])
        return [g.uuid for g in reading.gpus], sorted(p.pid for p in reading.gpu_processes)

    assert uuids() == ([UUID.format(0)], [100])
    fake_nvml.append("gpu.0.mig = 1")
    assert uuids() == ([UUID.format(0)], [4242])  # seen this sweep, enumerated after it
    assert uuids() == ([UUID.format(0), mig0, mig1], [4242])
    fake_nvml.write(fake_nvml.text.replace("mig.0.1.memory.used = 7\n", ""))  # destroyed
    uuids()  # its memory read answers NOT_FOUND: enumerate again
    assert uuids() == ([UUID.format(0), mig0], [4242])
    fake_nvml.append("gpu.0.mig = 0")
    uuids()
    gpus, procs = uuids()
    assert gpus == [UUID.format(0)] and procs == [100]  # the GPU's own list is read again
    assert by_index(src.sample([]))[0].util_gpu == 0.0  # utilization is back without MIG
    assert sum("MIG configuration changed" in r.getMessage() for r in caplog.records) == 3
    assert not any("failed" in r.getMessage() for r in caplog.records if r.levelno >= 30)
