"""Stragglers end to end (issue 22 §2): real torchrun jobs (3 ranks, gloo on CPU) under
``opentelemetry-instrument`` export their ranks' work per step over OTLP to a real
``otel-gpu processor``, whose notifications go to a webhook on 127.0.0.1. One rank computing
3x longer is named; a rank slow only in rare steps is not; all ranks slowing together is one
job-wide alert and no straggler. Straggler windows of 3 s (3 of 5 slow to be named) and 1 s
exports keep each job to about 30 s of training."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.cli import clean_env
from support.paths import ROOT
from support.ports import free_port
from support.processor import ProcessorProcess
from support.webhook import Webhook

pytestmark = pytest.mark.peers  # torchrun, and about 40 s each

JOB = ROOT / "tests" / "support" / "straggler_job.py"
BIN = os.path.dirname(sys.executable)  # the venv's opentelemetry-instrument
WINDOW_S = 3.0
SLOW_FROM = re.compile(r"rank (\d) slow from ([\d.]+)")


def _run_job(tmp_path: Path, mode: str, hook: Webhook) -> tuple[list[dict[str, Any]], str]:
    """The job ``mode`` against a fresh processor: (the notifications, each with the time it
    arrived as ``received_at``, and the job's output)."""
    processor = ProcessorProcess(
        "--listen", "127.0.0.1:0", "--export-interval", "1",
        env={"OTEL_GPU_WEBHOOK_URL": hook.url,
             "OTEL_GPU_DETECT_STRAGGLER_WINDOW_S": str(WINDOW_S)},
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = clean_env(
        PYTHONPATH=str(ROOT),
        OTEL_GPU_RUNTIME_DIR=str(run_dir),
        OTEL_SERVICE_NAME="straggler-test",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{processor.address}",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_GPU_DETECT="false",
    )
    log = tmp_path / "job.log"
    port = str(free_port())
    seen: list[dict[str, Any]] = []
    try:
        with open(log, "w") as out:
            job = subprocess.Popen(
                [os.path.join(BIN, "opentelemetry-instrument"), sys.executable, "-m",
                 "torch.distributed.run", "--nproc-per-node", "3", "--master-port", port,
                 str(JOB), mode],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 150
        while job.poll() is None and time.monotonic() < deadline:
            while len(seen) < len(hook.bodies):
                seen.append({**json.loads(hook.bodies[len(seen)]), "received_at": time.time()})
            time.sleep(0.1)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # this test's own job
            job.wait(10)
            pytest.fail(f"the job did not finish:\n{log.read_text()[-3000:]}")
        time.sleep(2 * WINDOW_S)  # the last exports judged, a late notification delivered
        while len(seen) < len(hook.bodies):
            seen.append({**json.loads(hook.bodies[len(seen)]), "received_at": time.time()})
        assert job.returncode == 0, log.read_text()[-3000:]
    finally:
        rc = processor.terminate()
    assert rc == 0, processor.output
    return seen, log.read_text()


def _opened(tmp_path: Path, mode: str) -> tuple[list[dict[str, Any]], str]:
    """The notifications of breakers opening during the job ``mode``, and its output."""
    hook = Webhook()
    try:
        seen, output = _run_job(tmp_path, mode, hook)
    finally:
        hook.close()
    return [n for n in seen if n["to_state"] == "open"], output


def test_a_rank_computing_three_times_longer_is_named(tmp_path: Path) -> None:
    opened, output = _opened(tmp_path, "one")
    (n,) = opened
    alert = n["alert"]
    assert alert["kind"] == "straggler" and alert["evidence"]["rank"] == 2.0, opened
    assert n["subject"].startswith("otel_gpu.job.id=") and n["subject"].endswith(" rank 2")
    assert "rank 2 (host " in alert["message"] and " is a straggler" in alert["message"]
    assert alert["evidence"]["ratio"] > 2.0
    # a CPU job: no torch.cuda series name the rank's GPU
    assert alert["diagnosis"]["lines"][0].startswith("GPU not known on host ")
    started = float(SLOW_FROM.search(output).group(2))  # type: ignore[union-attr]
    delay = n["received_at"] - started
    print(f"straggler named {delay:.1f} s after it slowed down (windows of {WINDOW_S:g} s)")
    assert 3 * WINDOW_S - 1 <= delay <= 5 * WINDOW_S + 4


def test_a_rank_slow_only_in_rare_steps_is_not_named(tmp_path: Path) -> None:
    opened, output = _opened(tmp_path, "rare")
    assert "done after" in output
    assert opened == []


def test_all_ranks_slowing_together_is_a_job_slowdown_not_a_straggler(tmp_path: Path) -> None:
    opened, output = _opened(tmp_path, "all")
    (n,) = opened
    alert = n["alert"]
    assert alert["evidence"]["rule"] == "job_slowdown", opened
    assert n["subject"].startswith("otel_gpu.job.id=") and " rank " not in n["subject"]
    assert "the whole job slowed down" in alert["message"]
    assert len(SLOW_FROM.findall(output)) == 3
