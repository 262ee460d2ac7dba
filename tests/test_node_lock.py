"""Exactly one sampler per node, however many processes of a job load the agent."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from opentelemetry.sdk.metrics import MeterProvider
    from otel_gpu.agent.agent import start_in_process
    from otel_gpu.agent.settings import Settings
    settings = Settings(simulate="steady", interval_s=0.1, exporter="none", detect=False,
                        lock_dir=sys.argv[1])
    agent = start_in_process(MeterProvider(), settings)
    print("owner" if agent is not None else "follower", flush=True)
    sys.stdin.readline()  # hold the lock until the test says so
    if agent is not None:
        started = agent.wait_started(10)
        print("sweeps", started is not None and started.sampler.sweeps > 0, flush=True)
        agent.shutdown(1.0)
    """
)


def _start(lock_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(lock_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.process
def test_only_the_first_process_samples_and_the_lock_is_freed_on_exit(tmp_path: Path) -> None:
    first = _start(tmp_path)
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline().strip() == "owner"
    second = _start(tmp_path)
    assert second.stdout is not None and second.stdin is not None
    assert second.stdout.readline().strip() == "follower"
    second.communicate("\n", timeout=30)
    out, _ = first.communicate("\n", timeout=30)
    assert "sweeps True" in out
    # The owner exited: the kernel released its flock, so the next process takes over.
    third = _start(tmp_path)
    assert third.stdout is not None
    assert third.stdout.readline().strip() == "owner"
    third.communicate("\n", timeout=30)


@pytest.mark.process
def test_start_in_process_never_raises_on_a_bad_lock_dir(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "missing" / "dir")],
        input="\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0
    assert res.stdout.startswith("follower")
    assert "node lock" in res.stderr


@pytest.mark.unit
def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    """Another user's symlink at the lock's name must not make us truncate its target."""
    from otel_gpu.agent.node_lock import LOCK_FILE, open_node_lock

    lock_dir = tmp_path / "locks"
    lock_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (lock_dir / LOCK_FILE).symlink_to(victim)
    assert open_node_lock(str(lock_dir)) is None
    assert victim.read_text() == "precious\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mode", "usable"),
    [(0o700, True), (0o755, True), (0o770, False), (0o777, False), (0o1777, False)],
)
def test_only_a_directory_only_this_user_can_write_holds_the_lock(
    tmp_path: Path, mode: int, usable: bool
) -> None:
    from otel_gpu.agent.node_lock import LOCK_FILE, open_node_lock

    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    lock_dir.chmod(mode)
    fd = open_node_lock(str(lock_dir))
    try:
        assert (fd is not None) == usable
        assert (lock_dir / LOCK_FILE).exists() == usable
    finally:
        if fd is not None:
            os.close(fd)


@pytest.mark.process
def test_the_default_lock_lives_in_a_private_directory(tmp_path: Path) -> None:
    """Without OTEL_GPU_LOCK_DIR, the lock goes in <temp>/otel-gpu-<uid>, created 0700 (the
    runtime directory, when neither OTEL_GPU_RUNTIME_DIR nor XDG_RUNTIME_DIR names one)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("OTEL_GPU_RUNTIME_DIR", "XDG_RUNTIME_DIR")
    }
    env["TMPDIR"] = str(tmp_path)
    res = subprocess.run(
        [sys.executable, "-c", "from otel_gpu.agent.node_lock import acquire_node_lock as a; print(a())"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert res.stdout.strip() == "True", res.stderr
    private = tmp_path / f"otel-gpu-{os.getuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert (private / "node.lock").read_text().strip().isdigit()
