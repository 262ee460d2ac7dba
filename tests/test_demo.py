"""`otel-gpu demo`, the Quickstart's first command, end to end."""

from __future__ import annotations

import subprocess
import sys


def test_demo_finds_the_leak_opens_the_breaker_and_notifies_within_a_minute() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "ALERT leak on gpu:" in out
    assert "closed -> open" in out
    assert "NOTIFICATION delivered to http://127.0.0.1:" in out
    assert '"to_state": "open"' in out  # the payload the webhook receiver got
    assert "hw.gpu.memory.usage" in out and "process.gpu.memory.usage" in out
    # Live status lines came before the alert: memory, utilization, the watched process.
    status = [line for line in out.splitlines() if line.startswith("[sim ")]
    assert len(status) >= 5 and "GPU0 mem" in status[0] and "pid " in status[0]
    assert "Traceback" not in res.stderr


def test_demo_steady_scenario_raises_no_alert() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_gpu.cli",
            "demo",
            "--scenario",
            "steady",
            "--max-seconds",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "ALERT" not in res.stdout and "no alert was raised" in res.stdout
