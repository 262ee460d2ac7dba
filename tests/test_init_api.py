"""``otel_gpu.init()``: the in-process part without ``opentelemetry-instrument`` (issue 19.5).

Real child interpreters exporting over the SDK's OTLP gRPC exporter to a receiver on
127.0.0.1 (or to a closed port, for the bounded shutdown).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import clean_env
from support.otlp_sink import OtlpSink
from support.ports import free_port

import otel_gpu

JOB = """
import sys, time
import otel_gpu
with otel_gpu.init(service_name="mine") as started:
    assert started.active and started.owned
    assert otel_gpu.init().owned is False  # once per process
    with otel_gpu.phase("train"):
        for i in range(1, 6):
            time.sleep(0.05)
            otel_gpu.step(i, loss=1.0 / i, lr=0.01)
    time.sleep(float(sys.argv[1]))
print("DONE")
"""


def _job(tmp_path: Path, endpoint: str, linger: float, **extra: str) -> tuple[int, str, float]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_METRIC_EXPORT_INTERVAL="200",
        OTEL_GPU_SIMULATE="steady",
        OTEL_GPU_INTERVAL="0.2",
        OTEL_GPU_LOCK_DIR=str(tmp_path),
        **extra,
    )
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), str(linger)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DONE" in proc.stdout
    return proc.returncode, proc.stderr, time.monotonic() - began


@pytest.mark.process
def test_init_exports_spans_training_metrics_and_the_node(tmp_path: Path) -> None:
    with OtlpSink() as sink:
        _job(tmp_path, sink.endpoint, 0.8)
        spans = sink.spans()
        points = sink.points()
    assert {"train", "step"} <= {s.name for s in spans}
    assert all(s.resource.get("service.name") == "mine" for s in spans)
    metrics = {p.metric for p in points}
    # training numbers, and the node's sampler (this process won the node lock)
    assert {"training.step", "training.loss", "training.learning_rate"} <= metrics
    assert "hw.gpu.utilization" in metrics


@pytest.mark.process
def test_init_shuts_down_within_its_bound_with_the_collector_down(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    _code, _err, took = _job(tmp_path, endpoint, 0.0, OTEL_GPU_SHUTDOWN_TIMEOUT="1")
    assert took < 12, took  # start-up (imports) plus at most the 1 s bound, not the SDK's 30 s


@pytest.mark.unit
def test_the_public_api_is_listed() -> None:
    assert dir(otel_gpu) == sorted(otel_gpu.__all__)
    assert {"init", "phase", "step", "request_stop", "current_phase"} <= set(dir(otel_gpu))
    assert callable(otel_gpu.init)
