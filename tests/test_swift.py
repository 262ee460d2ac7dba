"""``opentelemetry-instrument swift sft`` for real: offline, CPU, tiny generated model and data.

Spans, metrics and logs go over OTLP gRPC to a receiver started here. The node sampler runs on
the lead's simulated GPU (``OTEL_GPU_SIMULATE=steady``) so device series exist to be counted.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import swift  # noqa: F401  (a test dependency: fail, never skip)
from support.otlp_sink import OtlpSink
from support.ports import free_port
from support.tiny_training import offline_env, swift_sft_argv, write_swift_assets

pytestmark = pytest.mark.peers

BIN = Path(sys.executable).parent
INSTRUMENT = str(BIN / "opentelemetry-instrument")
SWIFT = shutil.which("swift", path=str(BIN)) or "swift"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A git work tree holding the generated model, tokenizer and data (cwd of the runs)."""
    root = tmp_path_factory.mktemp("swift")
    assets = write_swift_assets(root)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=root, check=True)
    (root / "train.sh").write_text("swift sft ...\n")
    subprocess.run([*git, "add", "train.sh"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], cwd=root, check=True)
    subprocess.run(
        ["git", "remote", "add", "origin", "https://github.com/example/tiny-sft.git"],
        cwd=root,
        check=True,
    )
    return root, assets


def _stopper_plugin(root: Path) -> Path:
    """An instrumentor package that asks for a stop from its own thread on rank 1 at step 3.

    It stands in for the detection engine: another component in the trainer process calling
    ``request_stop`` from another thread.
    """
    plugin = root / "stopper_plugin"
    info = plugin / "otel_gpu_test_stopper-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: otel-gpu-test-stopper\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[opentelemetry_instrumentor]\nzz_test_stopper = otel_gpu_test_stopper:Stopper\n"
    )
    (plugin / "otel_gpu_test_stopper.py").write_text(
        textwrap.dedent(
            """
            import os, sys, threading, time
            from otel_gpu.tracing import progress, request_stop

            class Stopper:
                def instrument(self, **kwargs):
                    if os.environ.get("RANK") != "1":
                        return
                    def watch():
                        while (progress.current_step() or 0) < 3:
                            time.sleep(0.005)
                        taken = request_stop("test detector: loss spike on rank 1")
                        print(f"STOPPER taken={taken}", file=sys.stderr, flush=True)
                    threading.Thread(target=watch, daemon=True).start()
            """
        )
    )
    return plugin


def _run(workdir, sink, out: Path, env_extra=None, **sft_overrides):
    root, assets = workdir
    env = offline_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
        OTEL_SERVICE_NAME="tiny-sft",
        OTEL_GPU_SIMULATE="steady",
        OTEL_GPU_INTERVAL="0.5",
        OTEL_METRIC_EXPORT_INTERVAL="500",
        OTEL_GPU_LOCK_DIR=str(out.parent),
        **(env_extra or {}),
    )
    cmd = [INSTRUMENT, SWIFT, *swift_sft_argv(assets, out, **sft_overrides)]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180)


def test_swift_sft_single_process(workdir, tmp_path):
    with OtlpSink() as sink:
        proc = _run(workdir, sink, tmp_path / "out")
        assert proc.returncode == 0, proc.stderr[-3000:]
        spans, points = sink.spans(), sink.points()

    names = collections.Counter(s.name for s in spans)
    assert names["train"] == 1 and names["load"] == 1
    assert names["step"] == 10
    assert names["evaluate"] == 2 and names["save_checkpoint"] == 2
    assert names["epoch"] >= 1
    (train,) = [s for s in spans if s.name == "train"]
    assert train.parent_id == ""  # the root
    assert {s.trace_id for s in spans} == {train.trace_id}
    assert train.attributes["training.tuner_type"] == "full"
    assert train.attributes["training.model_type"] == "qwen2"
    assert train.attributes["training.output_dir"] == str(tmp_path / "out")
    steps = [s for s in spans if s.name == "step"]
    logged = {s.attributes["training.step"] for s in steps if "training.loss" in s.attributes}
    assert {2, 4, 6, 8, 10} <= logged < set(range(1, 11))  # logging_steps=2 (+ the first)
    assert not any(isinstance(v, str) for s in steps for v in s.attributes.values())
    saves = sorted(
        s.attributes["training.checkpoint.path"] for s in spans if s.name == "save_checkpoint"
    )
    assert saves == [
        str(tmp_path / "out" / "checkpoint-10"),
        str(tmp_path / "out" / "checkpoint-5"),
    ]

    # Everything came from the trainer process: the `swift` launcher exported nothing.
    trainer_pid = train.resource["process.pid"]
    assert {s.resource["process.pid"] for s in spans} == {trainer_pid}
    assert {p.resource["process.pid"] for p in points} == {trainer_pid}
    assert len({p.peer for p in points} | {s.peer for s in spans}) == 1, proc.stderr[-2000:]
    assert train.resource["vcs.repository.url.full"] == "https://github.com/example/tiny-sft"
    assert len(train.resource["vcs.ref.head.revision"]) == 40
    metrics = {p.metric for p in points}
    assert {"training.step", "training.phase", "hw.gpu.utilization"} <= metrics, metrics
    last_step = max(p.value for p in points if p.metric == "training.step")
    assert last_step == 10, proc.stderr[-2000:]  # the final value, exported at exit
    current = {
        p.attributes["training.phase"]
        for p in points
        if p.metric == "training.phase" and p.value == 1
    }
    assert {"load", "train"} <= current, current


def test_swift_sft_two_ranks_one_trace_and_agreed_stop(workdir, tmp_path):
    root, _ = workdir
    plugin = _stopper_plugin(tmp_path)
    out = tmp_path / "out"
    with OtlpSink() as sink:
        env = {
            "NPROC_PER_NODE": "2",
            "MASTER_PORT": str(free_port()),
            "OTEL_GPU_STOP": "true",
            "OTEL_GPU_STOP_SYNC_STEPS": "1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(plugin), os.environ.get("PYTHONPATH")])
            ),
        }
        proc = _run(workdir, sink, out, env, ddp_backend="gloo", save_steps=100, eval_steps=100)
        # On a failure: the first rank's own error (torchrun's summary alone names no cause).
        first = "\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith("[rank0]"))
        assert proc.returncode == 0, first[-3000:] + "\n...\n" + proc.stderr[-3000:]
        spans, points, logs = sink.spans(), sink.points(), sink.logs()
    assert "STOPPER taken=True" in proc.stderr

    # One trace, one root: rank 0's `train`; rank 1's `train` hangs under it.
    assert len({s.trace_id for s in spans}) == 1
    trains = {s.attributes["otel_gpu.job.rank"]: s for s in spans if s.name == "train"}
    assert set(trains) == {0, 1}
    assert trains[0].parent_id == ""
    assert trains[1].parent_id == trains[0].span_id
    assert len({s.span_id for s in spans}) == len(spans)
    assert {s.attributes["otel_gpu.job.rank"] for s in spans if s.name == "step"} == {0, 1}

    # The stop asked on rank 1 stopped both ranks at the same step, with one checkpoint.
    events = [e for s in spans for e in s.events if e[0] == "otel_gpu.stop"]
    assert len(events) == 2
    stop_steps = {e[1]["training.step"] for e in events}
    assert len(stop_steps) == 1
    (stop_step,) = stop_steps
    assert 3 <= stop_step < 10
    assert {e[1]["otel_gpu.stop.requested_by_rank"] for e in events} == {1}
    assert [p.name for p in out.iterdir() if p.name.startswith("checkpoint-")] == [
        f"checkpoint-{stop_step}"
    ]
    for rank in (0, 1):
        last = max(
            s.attributes["training.step"]
            for s in spans
            if s.name == "step" and s.attributes["otel_gpu.job.rank"] == rank
        )
        assert last == stop_step
    reasons = [
        body for body, attrs, _, _ in logs if attrs.get("otel_gpu.stop.requested_by_rank") == 1
    ]
    assert any("loss spike on rank 1" in r for r in reasons)

    # Device series from exactly one process per node (local rank 0), none from the launchers.
    device_pids = {p.resource["process.pid"] for p in points if p.metric.startswith("hw.")}
    assert device_pids == {trains[0].resource["process.pid"]}
    assert {p.resource["process.pid"] for p in points} == {
        t.resource["process.pid"] for t in trains.values()
    }
