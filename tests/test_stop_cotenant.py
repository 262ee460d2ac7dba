"""A co-tenant's leak never stops the job (issue 18, item 9).

``OTEL_GPU_STOP_ON_ALERT=true`` through the real pynvml path (the fake libnvidia-ml): the job
is a real child of ``otel-gpu run`` that records the signals it gets; another real process,
outside the job, is listed on the same GPU. When the other process's memory grows (and with it
the GPU's) while the job's is flat, the leak alerts fire on ``gpu:<uuid>`` and on the other
process, and nothing is sent to the job; when the job's own memory grows, it is stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from support.tiny_training import offline_env

from otel_gpu.actions.trainers import GpuTenants, JobSubjects, not_the_jobs
from otel_gpu.detect.model import LEAK, STALL, Alert

pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "otel_gpu.cli"]
GIB = 1024**3
RATE = 50e6  # By/s: an alert within ~10 s with the windows below
FAST = {  # leak windows of seconds, so that a leak of a few seconds is found
    "OTEL_GPU_DETECT_LEAK_BUCKET_S": "0.25",
    "OTEL_GPU_DETECT_LEAK_MIN_WINDOW_S": "4",
    "OTEL_GPU_DETECT_LEAK_CONTEXT_S": "8",
}
JOB = r"""
import os, pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
def stop(sig, frame):
    marker.write_text(signal.Signals(sig).name)
    sys.exit(3)
signal.signal(signal.SIGUSR1, stop)
print(os.getpid(), flush=True)
time.sleep(float(sys.argv[2]))
"""


def _grow(fake: FakeNvml, job: int, other: int, grower: str, stop: threading.Event) -> None:
    """Rewrite the scenario 4 times a second: ``grower`` ("other" or "job") holds memory rising
    at RATE, and the GPU's memory (every process's) with it."""
    start = time.monotonic()
    while not stop.is_set():
        grown = int(RATE * (time.monotonic() - start))
        mine, theirs = (GIB + grown, 3 * GIB) if grower == "job" else (GIB, 3 * GIB + grown)
        fake.write(
            f"""
            devices = 1
            gpu.0.memory.total = {80 * GIB}
            gpu.0.memory.used = {mine + theirs + GIB // 2}
            gpu.0.util.gpu = 90
            gpu.0.processes = {job}:{mine} {other}:{theirs}
            """
        )
        stop.wait(0.25)


def _run(fake: FakeNvml, tmp_path: Path, grower: str) -> tuple[subprocess.CompletedProcess, Path]:
    marker, summary = tmp_path / "stopped", tmp_path / "summary.json"
    other = subprocess.Popen(["sleep", "60"])  # the co-tenant: not in the job's tree
    env = fake.env(
        offline_env(OTEL_GPU_STOP_ON_ALERT="true", CUDA_VISIBLE_DEVICES="0",
                    OTEL_GPU_LOCK_DIR=str(tmp_path), **FAST)
    )  # fmt: skip
    proc = subprocess.Popen(
        [*CLI, "run", "--exporter", "none", "--interval", "0.2", "--quiet",
         "--summary-json", str(summary), "--", sys.executable, "-c", JOB, str(marker), "25"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    stop = threading.Event()
    try:
        assert proc.stdout is not None
        job = int(proc.stdout.readline())
        grower_thread = threading.Thread(target=_grow, args=(fake, job, other.pid, grower, stop))
        grower_thread.start()
        out, err = proc.communicate(timeout=90)
    finally:
        stop.set()
        other.kill()
        other.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return res, summary


def test_a_co_tenants_leak_does_not_stop_the_job(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    res, summary = _run(fake_nvml, tmp_path, "other")
    assert res.returncode == 0, res.stderr[-3000:]  # the job ran to its end
    assert not (tmp_path / "stopped").exists()
    data = json.loads(summary.read_text())
    leaks = {a["subject"] for a in data["alerts"] if a["kind"] == LEAK}
    assert any(s.startswith("gpu:") for s in leaks), data["alerts"]  # the attack did fire
    assert "not stopping the job for leak on gpu:" in res.stderr
    assert "the job's own on it are not growing" in res.stderr
    assert data["actions"]["stops_requested"] == 0 and data["actions"]["stops_refused"] >= 1


def test_the_jobs_own_leak_still_stops_it(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    res, _summary = _run(fake_nvml, tmp_path, "job")
    assert (tmp_path / "stopped").read_text() == "SIGUSR1", res.stderr[-3000:]
    assert res.returncode == 3


SUBJECTS = JobSubjects(
    frozenset({"process:10@GPU-a", "process:11@GPU-b"}),
    {
        "GPU-a": GpuTenants(frozenset({"process:10@GPU-a"}), (99,)),  # shared with PID 99
        "GPU-b": GpuTenants(frozenset({"process:11@GPU-b"}), ()),  # the job's alone
        "GPU-c": GpuTenants(frozenset(), (99,)),  # not the job's at all
        "GPU-d": GpuTenants(frozenset({"process:12@GPU-d"}), None),  # processes not listed
    },
)


@pytest.mark.parametrize(
    ("kind", "subject", "leaking", "stops"),
    [
        (LEAK, "gpu:GPU-a", set(), False),  # shared, the job flat: the co-tenant's
        (LEAK, "gpu:GPU-a", {"process:10@GPU-a"}, True),  # shared, the job grows too: agree
        (LEAK, "gpu:GPU-b", set(), True),  # the job's alone
        (LEAK, "gpu:GPU-c", set(), False),
        (LEAK, "gpu:GPU-d", set(), False),  # unknown tenants: never on a guess
        (STALL, "gpu:GPU-a", set(), True),  # an idle GPU the job holds memory on
        (LEAK, "process:10@GPU-a", set(), True),
        (LEAK, "process:99@GPU-a", set(), False),  # the co-tenant itself
        (LEAK, "rss:10", set(), True),
    ],
)
def test_whose_alert_it_is(kind: str, subject: str, leaking: set[str], stops: bool) -> None:
    alert = Alert(kind, subject, 0.0, "critical", "x")
    assert (not_the_jobs(alert, SUBJECTS, leaking.__contains__) is None) is stops
