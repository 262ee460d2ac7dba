"""A crash or hang inside NVML or a /proc read never reaches the job (issue: "the job is sacred").

Real processes throughout: the C fake of libnvidia-ml aborts, segfaults or hangs inside a real
pynvml call; a FIFO in a fake /proc blocks a real read. Under ``otel-gpu run``, ``otel-gpu watch``
and ``opentelemetry-instrument`` the job must end with its own exit code, the wrapper must stay
until then, and metrics must come back after the sampler process is restarted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from otlp_sink import OtlpSink
from test_cli import CLI, _env

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")
GIB = 1024**3
JOB_SECONDS = 8.0
JOB_EXIT = 7

BASE_SCENARIO = """
devices = 1
gpu.0.memory.total = 85899345920
gpu.0.memory.used = 21474836480
gpu.0.util.gpu = 80
gpu.0.power.usage = 300000
gpu.0.power.limit = 700000
"""

# Each sampler process gets two good sweeps, then the third power reading goes wrong: a new
# process (the fake counts calls per process) reads again, so metrics resume after each restart.
FAULTS = {
    "abort": ("fail.nvmlDeviceGetPowerUsage = ABORT after=2", "SIGABRT"),
    "segv": ("fail.nvmlDeviceGetPowerUsage = SEGV after=2", "SIGSEGV"),
    "hang": ("delay.nvmlDeviceGetPowerUsage = 600000 after=2", "hung in an NVML call"),
}

JOB = f"import sys, time; time.sleep({JOB_SECONDS}); sys.exit({JOB_EXIT})"


def _env_for(fake: FakeNvml, **extra: str) -> dict[str, str]:
    return fake.env(
        _env(
            OTEL_GPU_NVML_TIMEOUT="0.3",  # a hung call is abandoned after 0.3 s...
            OTEL_GPU_DETECT="false",
            **extra,
        )
    )


def _console_points(out: str) -> list[tuple[str, dict, float, int]]:
    """(name, attributes, value, export number) of every point the console exporter printed."""
    decoder = json.JSONDecoder()
    points = []
    i, n = 0, 0
    while True:
        start = out.find("{", i)
        if start < 0:
            return points
        doc, i = decoder.raw_decode(out, start)
        n += 1
        for rm in doc.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for m in sm["metrics"]:
                    for p in m["data"]["data_points"]:
                        points.append((m["name"], p["attributes"], p["value"], n))


def _check_recovered(
    points: list[tuple[str, dict, float, int]], *, gpus_known: bool = True
) -> None:
    restarts = [v for name, _a, v, _n in points if name == "otel_gpu.agent.sampler.restarts"]
    assert restarts and max(restarts) >= 1, "the sampler process was never restarted"
    # Metrics came back after a restart: an export that counts a restart also carries memory.
    after = {n for name, _a, v, n in points if name == "otel_gpu.agent.sampler.restarts" and v >= 1}
    memory = {n for name, _a, _v, n in points if name == "hw.gpu.memory.usage"}
    assert after & memory, "no GPU metrics after the sampler was restarted"
    if not gpus_known:  # the first sampler hung before it saw any GPU
        return
    # While it was down the GPU was shown as not readable (degraded), not with old values.
    degraded = [
        a
        for name, a, v, _n in points
        if name == "hw.status" and a["hw.state"] == "degraded" and v == 1
    ]
    assert degraded


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_run_survives_a_native_fault_or_hang_in_nvml(fake_nvml: FakeNvml, fault: str) -> None:
    rule, what = FAULTS[fault]
    fake_nvml.write(BASE_SCENARIO + rule + "\n")
    began = time.monotonic()
    proc = subprocess.run(
        [*CLI, "run", "--exporter", "console", "--interval", "0.25", "--export-interval", "0.5",
         "--", sys.executable, "-c", JOB],
        capture_output=True, text=True, timeout=90, env=_env_for(fake_nvml),
    )  # fmt: skip
    took = time.monotonic() - began
    assert proc.returncode == JOB_EXIT, proc.stderr[-3000:]
    assert took >= JOB_SECONDS  # the wrapper stayed until the job ended
    _check_recovered(_console_points(proc.stdout))
    warnings = [line for line in proc.stderr.splitlines() if "sampler process" in line]
    # One warning for the episode (the restarts after it are logged at debug level).
    assert len(warnings) == 1 and what in warnings[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("Fatal Python error")[0]


def test_watch_survives_an_nvml_abort(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(BASE_SCENARIO + FAULTS["abort"][0] + "\n")
    job = subprocess.Popen([sys.executable, "-c", JOB])
    try:
        proc = subprocess.run(
            [*CLI, "watch", "--pid", str(job.pid), "--exporter", "console", "--interval", "0.25",
             "--export-interval", "0.5"],
            capture_output=True, text=True, timeout=90, env=_env_for(fake_nvml),
        )  # fmt: skip
        assert job.wait(timeout=30) == JOB_EXIT
    finally:
        job.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]  # watch ends when the job does
    _check_recovered(_console_points(proc.stdout))


def _blocking_proc_root(tmp_path: Path) -> Path:
    """A /proc whose process entry 4190001 has a FIFO for ``stat``: opening it blocks forever
    (nobody writes), as a read of a process stuck in the kernel does."""
    root = tmp_path / "proc"
    (root / "4190001").mkdir(parents=True)
    os.mkfifo(root / "4190001" / "stat")
    for name in ("stat", "uptime", "self"):
        (root / name).symlink_to(f"/proc/{name}")
    return root


def test_run_survives_a_proc_read_that_blocks(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.write(BASE_SCENARIO)
    root = _blocking_proc_root(tmp_path)
    proc = subprocess.run(
        [*CLI, "run", "--exporter", "console", "--interval", "0.25", "--export-interval", "0.5",
         "--", sys.executable, "-c", JOB],
        capture_output=True, text=True, timeout=90,
        env=_env_for(fake_nvml, OTEL_GPU_PROC_ROOT=str(root)),
    )  # fmt: skip
    assert proc.returncode == JOB_EXIT, proc.stderr[-3000:]
    points = _console_points(proc.stdout)
    _check_recovered(points, gpus_known=False)
    # Before the first snapshot the age counts from the start: the stuck sweep was visible.
    ages = [v for name, _a, v, _n in points if name == "otel_gpu.agent.snapshot.age"]
    assert max(ages) > 2.0
    assert "a /proc read of PID 4190001 hung" in proc.stderr
    # The next sampler skips that PID, so it keeps sampling: memory in (almost) every export
    # after the restart, not just one.
    after = {n for name, _a, v, n in points if name == "otel_gpu.agent.sampler.restarts" and v}
    memory = {n for name, _a, _v, n in points if name == "hw.gpu.memory.usage"}
    assert len(after & memory) >= 3


def test_instrumented_trainer_survives_an_nvml_abort(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.write(BASE_SCENARIO + FAULTS["abort"][0] + "\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, time\n"
        "from otel_gpu.tracing import phase, step\n"
        "with phase('train'):\n"
        f"    for i in range({int(JOB_SECONDS * 10)}):\n"
        "        time.sleep(0.1)\n"
        "        step(i + 1, loss=1.0)\n"
        "print('trained', flush=True)\n"
        f"sys.exit({JOB_EXIT})\n"
    )
    with OtlpSink() as sink:
        env = _env_for(
            fake_nvml,
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
            OTEL_METRIC_EXPORT_INTERVAL="500",
            OTEL_GPU_INTERVAL="0.25",
            OTEL_GPU_LOCK_DIR=str(tmp_path),
            OTEL_TRACES_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
        )
        proc = subprocess.run(
            [INSTRUMENT, sys.executable, str(script)],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        )  # fmt: skip
        points = sink.points()
    assert proc.returncode == JOB_EXIT, proc.stderr[-3000:]
    assert proc.stdout == "trained\n"
    restarts = [p.value for p in points if p.metric == "otel_gpu.agent.sampler.restarts"]
    assert restarts and max(restarts) >= 1
    first_restart_time = min(
        p.time_ns for p in points if p.metric == "otel_gpu.agent.sampler.restarts" and p.value >= 1
    )
    assert any(
        p.metric == "hw.gpu.memory.usage" and p.time_ns >= first_restart_time for p in points
    ), "no GPU metrics after the restart"
    assert "SIGABRT" in proc.stderr
