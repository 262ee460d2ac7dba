"""benchmarks/device_check.py, the check prepared for the first real GPU, in its no-GPU mode:
it says so, compares what it can (the fake's side) and exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_so_probes_the_fake_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {k: v for k, v in __import__("os").environ.items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--seconds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no NVIDIA GPU here" in proc.stdout
    report = json.loads(out.read_text())
    assert report["gpu"] is False
    fake = report["fake"]
    # Every symbol the agent calls is found, and the fake exports each one.
    assert {"nvmlInit", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetProcessUtilization"} <= set(
        report["symbols"]
    )
    assert all(fake["exported"].values()), [s for s, ok in fake["exported"].items() if not ok]
    # The agent's own source ran sweeps on the fake, every call timed with its result.
    assert fake["gpus"] == 2 and len(fake["sweep_ms"]) == 5
    memory = fake["calls"]["nvmlDeviceGetMemoryInfo"]
    assert memory["count"] >= 5 and memory["results"].get("ok") and memory["median_us"] > 0
    assert "nvmlDeviceGetMemoryInfo" in proc.stdout
