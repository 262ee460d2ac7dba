"""`otel-gpu demo`, the Quickstart's first command, end to end."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from otel_gpu.commands.demo import NEXT

pytestmark = pytest.mark.peers


def test_demo_finds_the_leak_opens_the_breaker_and_notifies_within_a_minute() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "ALERT leak on GPU0 51a1a7ed Simulated H100 80GB: memory leak suspected" in out
    assert "closed -> open" in out
    assert "NOTIFICATION delivered to http://127.0.0.1:" in out
    assert '"to_state": "open"' in out  # the payload the webhook receiver got
    assert "hw.gpu.memory.usage" in out and "process.gpu.memory.usage" in out
    # The live view (one line per interval on stderr, which is not a terminal here): memory,
    # utilization, the watched process on the GPU, in simulated time.
    status = [line for line in res.stderr.splitlines() if line.startswith("otel-gpu demo (")]
    assert len(status) >= 5 and "GPU0 51a1a7ed" in status[-1] and " GiB util " in status[-1]
    assert re.search(r" \| python\S* \d+ GPU0 [\d.]+ GiB floor [+-]\d+ MB/h ", status[-1])
    # ... and the end-of-run summary, with the leak.
    summary = res.stderr[res.stderr.index("otel-gpu summary") :]
    assert re.search(r"alerts: [1-9]", summary) and "  leak GPU0 51a1a7ed" in summary
    assert "Traceback" not in res.stderr
    # It ends by saying what to run on a real job.
    assert out.splitlines()[-1] == NEXT
    assert NEXT.startswith("next: otel-gpu run -- opentelemetry-instrument python train.py")


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
    assert res.stdout.splitlines()[-1] == NEXT
