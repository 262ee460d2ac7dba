"""`otel-gpu run` and `doctor` through the real pynvml path, with the fake libnvidia-ml found on
LD_LIBRARY_PATH exactly as the real one would be."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from fakenvml.fixtures import FakeNvml
from support.cli import CLI, clean_env
from support.console import console_points_by_name

GIB = 1024**3


@pytest.mark.peers
def test_run_exports_nvml_device_and_process_points_for_the_child(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(
        """
        devices = 2
        gpu.*.memory.total = 85899345920
        gpu.0.memory.used = 21474836480
        gpu.1.memory.used = 1073741824
        gpu.*.util.gpu = 87
        gpu.*.power.usage = 455500
        gpu.*.power.limit = 700000
        gpu.*.temperature = 66
        """
    )
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(4)"
    proc = subprocess.Popen(
        [*CLI, "run", "--exporter", "console", "--no-instrument", "--interval", "0.2", "--export-interval", "1",
         "--no-detect", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=fake_nvml.env(clean_env(CUDA_VISIBLE_DEVICES="0")),
    )  # fmt: skip
    assert proc.stdout is not None
    child_pid = int(proc.stdout.readline())
    # Now NVML lists the child on GPU 0 (the fake re-reads its scenario within 10 ms).
    fake_nvml.append(f"gpu.0.processes = {child_pid}:{3 * GIB}")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    pts = console_points_by_name(out)
    # CUDA_VISIBLE_DEVICES=0: only GPU 0 belongs to the job.
    assert {p["attributes"]["gpu.index"] for p in pts["hw.gpu.memory.usage"]} == {0}
    assert {p["value"] for p in pts["hw.gpu.memory.usage"]} == {20 * GIB}
    assert {p["value"] for p in pts["hw.power"]} == {455.5}  # mW -> W
    general = [p for p in pts["hw.gpu.utilization"] if p["attributes"]["hw.gpu.task"] == "general"]
    assert {p["value"] for p in general} == {0.87}  # % -> fraction
    gpu_proc = [
        p for p in pts["process.gpu.memory.usage"] if p["attributes"]["process.pid"] == child_pid
    ]
    assert gpu_proc and {p["value"] for p in gpu_proc} == {3 * GIB}
    # While the child runs its GPU memory carries its /proc identity. (After it exits, NVML may
    # still list it for a sweep: then the point keeps only the PID, which is also right.)
    names = {p["attributes"].get("process.executable.name", "") for p in gpu_proc}
    assert any(name.startswith("python") for name in names)
    assert child_pid in {p["attributes"]["process.pid"] for p in pts["process.memory.usage"]}


@pytest.mark.process
def test_doctor_reports_gpus_and_the_unreachable_endpoint(fake_nvml: FakeNvml) -> None:
    fake_nvml.write("devices = 2\ndriver_version = 550.54.15\ncuda_driver_version = 12040\n")
    res = subprocess.run(
        [*CLI, "doctor", "--endpoint", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=fake_nvml.env(clean_env()),
    )  # fmt: skip
    lines = res.stdout.splitlines()
    assert any(
        line.startswith("ok") and "driver 550.54.15, CUDA driver 12.4" in line for line in lines
    )
    assert sum(re.match(r"ok +gpu \d: ", line) is not None for line in lines) == 2
    assert any(
        line.startswith("fail  exporter") and "127.0.0.1:9: refused" in line for line in lines
    )
    assert res.returncode == 1  # a failed check
    assert "Traceback" not in res.stderr


@pytest.mark.process
def test_doctor_without_nvml_says_how_to_fix_it(tmp_path) -> None:
    res = subprocess.run(
        [*CLI, "doctor", "--endpoint", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60,
        env=clean_env(LD_LIBRARY_PATH=str(tmp_path)),  # no libnvidia-ml.so.1 to be found
    )  # fmt: skip
    nvml = [line for line in res.stdout.splitlines() if "nvml:" in line]
    assert nvml and nvml[0].startswith("fail") and "->" in nvml[0]
    assert res.returncode == 1 and "Traceback" not in res.stderr
