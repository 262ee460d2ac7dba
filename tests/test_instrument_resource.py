"""`opentelemetry-instrument` with our git detector selected puts vcs.* on the resource."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]


def test_git_detector_selected_by_name_reaches_an_instrumented_runs_resource() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel_gpu_git",
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_GPU_ROLE="trainer",  # spans only: no node sampler in this check
    )
    instrument = Path(sys.executable).with_name("opentelemetry-instrument")
    code = "from opentelemetry import trace; trace.get_tracer('t').start_span('probe').end()"
    res = subprocess.run(
        [str(instrument), sys.executable, "-c", code],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    span = json.loads(res.stdout[res.stdout.index("{") :])
    attrs = span["resource"]["attributes"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert attrs["vcs.ref.head.revision"] == head
    assert span["name"] == "probe"
