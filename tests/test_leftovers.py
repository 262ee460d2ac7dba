"""GPU processes that outlive the job are said so (issue 18, item 20): a real job starts a
``setsid`` daemon and exits 0; the (fake) driver still lists the daemon on the GPU. The summary
names it, ``--summary-json`` lists it, and an ``orphan`` alert is raised and logged; a process
that was never the job's is not blamed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from support.tiny_training import offline_env

pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "otel_gpu.cli"]
GIB = 1024**3
# The job: a daemon in a session of its own (it leaves the job's group, so nothing ends it
# with the job), seen in the tree for a few sweeps, then the job exits 0 without it.
JOB = r"""
import subprocess, sys, time
daemon = subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(daemon.pid, flush=True)
sys.stdin.readline()  # the test has listed it on the GPU
time.sleep(1.5)
"""


def test_a_daemon_the_job_left_on_the_gpu_is_reported(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "60"])  # never the job's: not to be blamed
    summary = tmp_path / "summary.json"
    proc = subprocess.Popen(
        [*CLI, "run", "--exporter", "none", "--interval", "0.2", "--summary-json", str(summary),
         "--", sys.executable, "-c", JOB],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=fake_nvml.env(offline_env(CUDA_VISIBLE_DEVICES="0", OTEL_GPU_LOCK_DIR=str(tmp_path))),
    )  # fmt: skip
    daemon = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        daemon = int(proc.stdout.readline())
        fake_nvml.write(
            f"""
            devices = 1
            gpu.0.memory.total = {80 * GIB}
            gpu.0.memory.used = {24 * GIB}
            gpu.0.processes = {daemon}:{20 * GIB} {stranger.pid}:{2 * GIB}
            """
        )
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _out, err = proc.communicate(timeout=60)
    finally:
        for pid in (daemon, stranger.pid):
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        stranger.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    text = err[err.index("otel-gpu summary") :]
    assert f"still running after the job: sleep (PID {daemon}) holds 20.0 GiB on GPU0" in text
    data = json.loads(summary.read_text())
    (left,) = data["leftovers"]
    assert left["pid"] == daemon and left["used_bytes"] == 20 * GIB and left["gpu"] == "GPU0"
    (orphan,) = [a for a in data["alerts"] if a["kind"] == "orphan"]
    assert orphan["subject"].startswith(f"process:{daemon}@")
    assert f"sleep (PID {daemon}), started by the job, still runs" in orphan["message"]
    assert f"breaker process:{daemon}@" in err  # logged through the actions, as any alert
    assert str(stranger.pid) not in json.dumps(data["leftovers"])
