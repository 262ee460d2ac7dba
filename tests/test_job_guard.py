"""The job dies with its wrapper (issue 18, item 10): a real ``kill -9`` of ``otel-gpu run``
(what ``timeout -k``, a CI runner's group kill or the OOM killer do) ends the job's whole
process group — its launcher and the trainer it started — with SIGTERM, then SIGKILL for what
ignores it; while the wrapper lives, exit codes and signals are the job's as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.tiny_training import offline_env

from otel_gpu.agent.job_guard import GRACE_S

pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "otel_gpu.cli"]

# A launcher (the job's leader) that starts a trainer, as torchrun or swift do, and prints both
# PIDs; the trainer ignores SIGTERM when asked to (a checkpoint that never ends).
LAUNCHER = r"""
import os, signal, subprocess, sys, time
trainer = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\n"
    "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n", sys.argv[1]], stdout=subprocess.PIPE)
trainer.stdout.readline()  # its SIGTERM disposition is set
print(os.getpid(), trainer.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], within_s: float) -> float:
    start = time.monotonic()
    while any(alive(p) for p in pids):
        assert time.monotonic() - start < within_s, (
            f"still running: {[p for p in pids if alive(p)]}"
        )
        time.sleep(0.05)
    return time.monotonic() - start


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    wrapper = subprocess.Popen(
        [*CLI, "run", "--simulate", "steady", "--exporter", "none", "--quiet", "--",
         sys.executable, str(script), mode],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=offline_env(OTEL_GPU_LOCK_DIR=str(tmp_path)),
    )  # fmt: skip
    assert wrapper.stdout is not None
    pids = [int(p) for p in wrapper.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    return wrapper, pids


def cleanup(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("mode", "within_s"), [("plain", 5.0), ("stubborn", GRACE_S + 5.0)])
def test_kill_9_of_the_wrapper_ends_the_whole_job(
    tmp_path: Path, mode: str, within_s: float
) -> None:
    wrapper, pids = start(tmp_path, mode)
    try:
        wrapper.send_signal(signal.SIGKILL)
        assert wrapper.wait(10) == -signal.SIGKILL
        took = wait_gone(pids, within_s)
        if mode == "stubborn":  # SIGTERM first; SIGKILL only after the grace
            assert took >= GRACE_S - 1.0
    finally:
        cleanup(pids)


def test_a_signal_to_the_guard_reaches_the_job(tmp_path: Path) -> None:
    """otel-gpu shows and watches the job's own PID; ``kill`` of the guard's (the job's
    parent and group leader in ``ps``) is passed on to the job's group."""
    wrapper, pids = start(tmp_path, "plain")
    guard = os.getpgid(pids[0])  # the session and group leader
    try:
        assert guard not in pids and guard != wrapper.pid
        os.kill(guard, signal.SIGTERM)
        assert wrapper.wait(20) == 128 + signal.SIGTERM  # the job's death, reported as always
        wait_gone(pids, 5.0)
    finally:
        cleanup(pids)


def test_exit_codes_and_deaths_are_the_jobs(tmp_path: Path) -> None:
    for code, expected in (("raise SystemExit(7)", 7), ("import os; os.abort()", 128 + 6)):
        res = subprocess.run(
            [*CLI, "run", "--simulate", "steady", "--exporter", "none", "--quiet", "--",
             sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env=offline_env(OTEL_GPU_LOCK_DIR=str(tmp_path)),
        )  # fmt: skip
        assert res.returncode == expected, res.stderr
    assert not list(tmp_path.glob("core*"))  # the guard re-raised SIGABRT without a core
