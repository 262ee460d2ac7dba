"""A crash or hang inside NVML or a /proc read never reaches the job (issue: "the job is sacred").

Real processes throughout: the C fake of libnvidia-ml aborts, segfaults or hangs inside a real
pynvml call; a FIFO in a fake /proc blocks a real read. Under ``otel-gpu run``, ``otel-gpu watch``
and ``opentelemetry-instrument`` the job must end with its own exit code, the wrapper must stay
until then, and metrics must come back after the sampler process is restarted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from support.cli import CLI, clean_env
from support.console import console_points
from support.otlp_sink import OtlpSink
from support.procfs import BLOCKED_PID, blocking_proc_root
from support.scenarios import ONE_GPU_SCENARIO

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")
GIB = 1024**3
JOB_SECONDS = 8.0
JOB_EXIT = 7


# Each sampler process gets two good sweeps, then the third power reading goes wrong: a new
# process (the fake counts calls per process) reads again, so metrics resume after each restart.
FAULTS = {
    "abort": ("fail.nvmlDeviceGetPowerUsage = ABORT after=2", "SIGABRT"),
    "segv": ("fail.nvmlDeviceGetPowerUsage = SEGV after=2", "SIGSEGV"),
    "hang": ("delay.nvmlDeviceGetPowerUsage = 600000 after=2", "hung in an NVML call"),
    "proc": ("", "hung reading /proc/4190001"),  # a FIFO in a fake /proc (below)
}

JOB = f"import sys, time; time.sleep({JOB_SECONDS}); sys.exit({JOB_EXIT})"


def _env_for(fake: FakeNvml, **extra: str) -> dict[str, str]:
    return fake.env(
        clean_env(
            OTEL_GPU_NVML_TIMEOUT="0.3",  # a hung call is abandoned after 0.3 s...
            OTEL_GPU_DETECT="false",
            **extra,
        )
    )


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


def _arm(fault: str, fake: FakeNvml, tmp_path: Path, **extra: str) -> dict[str, str]:
    """Write the fault into the fake's scenario (or the fake /proc); the agent's environment."""
    rule, _what = FAULTS[fault]
    fake.write(ONE_GPU_SCENARIO + rule + "\n")
    if fault == "proc":
        extra["OTEL_GPU_PROC_ROOT"] = str(blocking_proc_root(tmp_path))
    return _env_for(fake, **extra)


def _check_log(fault: str, stderr: str) -> None:
    warnings = [line for line in stderr.splitlines() if "sampler process" in line]
    # One warning for the episode (the restarts after it are logged at debug level).
    assert len(warnings) == 1 and FAULTS[fault][1] in warnings[0], stderr[-3000:]
    assert "Traceback" not in stderr.split("Fatal Python error")[0]
    if fault == "proc":
        assert f"a /proc read of PID {BLOCKED_PID} hung" in stderr


def _check_points(fault: str, points: list[tuple[str, dict, float, int]]) -> None:
    _check_recovered(points, gpus_known=fault != "proc")
    if fault == "proc":
        # The next sampler skips that PID, so it keeps sampling: memory in several exports
        # after the restart, not just one; and the age counted from the start meanwhile.
        after = {n for name, _a, v, n in points if name == "otel_gpu.agent.sampler.restarts" and v}
        memory = {n for name, _a, _v, n in points if name == "hw.gpu.memory.usage"}
        assert len(after & memory) >= 3
        ages = [v for name, _a, v, _n in points if name == "otel_gpu.agent.snapshot.age"]
        assert max(ages) > 2.0


@pytest.mark.peers
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_run_survives(fake_nvml: FakeNvml, tmp_path: Path, fault: str) -> None:
    env = _arm(fault, fake_nvml, tmp_path)
    began = time.monotonic()
    proc = subprocess.run(
        [*CLI, "run", "--exporter", "console", "--interval", "0.25", "--export-interval", "0.5",
         "--", sys.executable, "-c", JOB],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip
    took = time.monotonic() - began
    assert proc.returncode == JOB_EXIT, proc.stderr[-3000:]
    assert took >= JOB_SECONDS  # the wrapper stayed until the job ended
    _check_points(fault, console_points(proc.stdout))
    _check_log(fault, proc.stderr)


@pytest.mark.peers
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_watch_survives(fake_nvml: FakeNvml, tmp_path: Path, fault: str) -> None:
    env = _arm(fault, fake_nvml, tmp_path)
    job = subprocess.Popen([sys.executable, "-c", JOB])
    try:
        proc = subprocess.run(
            [*CLI, "watch", "--pid", str(job.pid), "--exporter", "console", "--interval", "0.25",
             "--export-interval", "0.5"],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
        assert job.wait(timeout=30) == JOB_EXIT  # the job was never touched
    finally:
        job.kill()
        job.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]  # watch ends when the job does
    _check_points(fault, console_points(proc.stdout))
    _check_log(fault, proc.stderr)


@pytest.mark.peers
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_instrumented_trainer_survives(fake_nvml: FakeNvml, tmp_path: Path, fault: str) -> None:
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
        env = _arm(
            fault,
            fake_nvml,
            tmp_path,
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
    assert proc.stdout == "trained\n"  # the trainer ran to its end, undisturbed
    restarts = [p.value for p in points if p.metric == "otel_gpu.agent.sampler.restarts"]
    assert restarts and max(restarts) >= 1
    first_restart_time = min(
        p.time_ns for p in points if p.metric == "otel_gpu.agent.sampler.restarts" and p.value >= 1
    )
    assert any(
        p.metric == "hw.gpu.memory.usage" and p.time_ns >= first_restart_time for p in points
    ), "no GPU metrics after the restart"
    _check_log(fault, proc.stderr)


@pytest.mark.process
def test_sampling_works_in_a_process_holding_more_than_1024_files(tmp_path: Path) -> None:
    """An instrumented trainer may hold thousands of files and sockets: the pipe from the
    sampling helper then gets a descriptor above select()'s 1024 limit."""
    code = """
import os, resource, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
agent = Agent(Settings(interval_s=0.2, simulate="steady", detect=False), roots=[os.getpid()])
agent.start()
deadline = time.monotonic() + 20
while agent.sampler.sweeps < 3 and time.monotonic() < deadline:
    time.sleep(0.1)
print(agent.sampler.sweeps, agent.sampler.restarts, flush=True)
agent.shutdown(2.0)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweeps, restarts = map(int, proc.stdout.split())
    assert sweeps >= 3 and restarts == 0, proc.stderr[-2000:]
