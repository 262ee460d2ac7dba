"""Exactly one sampler per node, however many processes of a job load the agent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from opentelemetry.sdk.metrics import MeterProvider
    from otel_gpu.agent import start_in_process
    from otel_gpu.config import Settings
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
