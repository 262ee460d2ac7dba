"""No job left silent (issue 19.4): a second instrumented job of the same user exports its own
telemetry whatever the node lock, the lock is per visible-GPU set, a process that does not
sample says so once and names who does, ``doctor`` names the lock's holder, and the SDK's
export retries inside an instrumented job are one line per episode.

Real processes: two concurrent ``opentelemetry-instrument python`` jobs exporting to one OTLP
gRPC receiver on 127.0.0.1; ``otel-gpu doctor`` while one of them holds the lock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import CLI, clean_env
from support.otlp_sink import OtlpSink
from support.ports import free_port

pytestmark = pytest.mark.peers

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")

JOB = """
import os, sys, time
import otel_gpu
print("PID", os.getpid(), flush=True)
with otel_gpu.phase("train"):
    for i in range(1, 6):
        time.sleep(0.05)
        otel_gpu.step(i, loss=1.0 / i)
    time.sleep(float(sys.argv[1]))
print("DONE", flush=True)
"""


def _start(tmp_path: Path, name: str, endpoint: str, linger: float, **extra: str):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = clean_env(
        OTEL_SERVICE_NAME=name,
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_METRIC_EXPORT_INTERVAL="200",
        OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_GPU_SIMULATE="steady",
        OTEL_GPU_INTERVAL="0.2",
        OTEL_GPU_LOCK_DIR=str(tmp_path),
        **extra,
    )
    return subprocess.Popen(
        [INSTRUMENT, sys.executable, str(script), str(linger)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for_lock(tmp_path: Path, name: str = "node.lock") -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lock = tmp_path / name
        if lock.exists() and lock.read_text().strip():
            return
        time.sleep(0.05)
    raise AssertionError("the first job never took the node lock")


def _services(points, metric: str) -> set[str]:
    return {p.resource.get("service.name") for p in points if p.metric == metric}


def test_a_second_job_exports_its_own_and_says_once_who_samples(tmp_path: Path) -> None:
    with OtlpSink() as sink:
        first = _start(tmp_path, "job-a", sink.endpoint, 6.0)
        _wait_for_lock(tmp_path)
        doctor = subprocess.run(
            [*CLI, "doctor", "--simulate", "steady", "--json"],
            env=clean_env(OTEL_GPU_LOCK_DIR=str(tmp_path), OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        second = _start(tmp_path, "job-b", sink.endpoint, 1.0)
        out_b, err_b = second.communicate(timeout=120)
        out_a, err_a = first.communicate(timeout=120)
        spans, points = sink.spans(), sink.points()
    assert first.returncode == second.returncode == 0, (err_a[-2000:], err_b[-2000:])
    pid_a = int(out_a.split()[1])
    # The second job's own spans and training metrics, whatever the lock.
    assert {"job-a", "job-b"} <= {s.resource.get("service.name") for s in spans if s.name == "step"}
    assert {"job-a", "job-b"} <= _services(points, "training.loss")
    # One sampler for the shared GPUs: the first job's; the second says so once, naming it.
    assert _services(points, "hw.gpu.utilization") == {"job-a"}
    said = [line for line in err_b.splitlines() if "not sampling GPUs" in line]
    assert len(said) == 1 and f"PID {pid_a} (" in said[0], err_b[-2000:]
    assert "not sampling" not in err_a
    checks = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "node lock"]
    assert any(f"sampled by PID {pid_a} (" in c["detail"] for c in checks), checks


def test_jobs_on_other_gpus_each_sample_their_own(tmp_path: Path) -> None:
    with OtlpSink() as sink:
        first = _start(tmp_path, "job-a", sink.endpoint, 3.0, CUDA_VISIBLE_DEVICES="0")
        _wait_for_lock(tmp_path, "node-0.lock")
        second = _start(tmp_path, "job-b", sink.endpoint, 1.0, CUDA_VISIBLE_DEVICES="1")
        _out_b, err_b = second.communicate(timeout=120)
        first.communicate(timeout=120)
        points = sink.points()
    assert "not sampling" not in err_b
    assert (tmp_path / "node-1.lock").exists()
    assert _services(points, "hw.gpu.utilization") == {"job-a", "job-b"}


def test_export_retries_in_an_instrumented_job_are_one_line_per_episode(tmp_path: Path) -> None:
    job = _start(tmp_path, "job-a", f"http://127.0.0.1:{free_port()}", 2.0,
                 OTEL_GPU_SHUTDOWN_TIMEOUT="1")  # fmt: skip
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0 and "DONE" in out, err[-2000:]
    assert "Transient error" not in err and "Failed to export" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if "export to" in line and "failed" in line]
    assert 1 <= len(failed) <= 3, err[-3000:]  # one per signal's episode, at most
