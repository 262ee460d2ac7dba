"""The distro and configurator: process roles, the run's trace context, bounded shutdown,
settings errors, ``--gpu_*`` flags and forked DataLoader workers (real subprocesses)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.otlp_sink import OtlpSink
from support.tiny_training import offline_env

from otel_gpu.core.errors import UsageError
from otel_gpu.tracing import context, ids
from otel_gpu.tracing.settings import TracingSettings

BIN = Path(sys.executable).parent
INSTRUMENT = str(BIN / "opentelemetry-instrument")
PY = sys.executable
TESTS = str(Path(__file__).parent)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "env", "role"),
    [
        (["python", "/venv/bin/swift", "sft", "--model", "m"], {}, "launcher"),
        (["python", "/venv/bin/torchrun", "--nproc_per_node", "2", "t.py"], {}, "launcher"),
        (
            ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"],
            {},
            "launcher",
        ),
        (["python", "-u", "-m", "torch.distributed.run", "t.py"], {}, "launcher"),
        (["/usr/bin/python3", "/venv/bin/accelerate", "launch", "t.py"], {}, "launcher"),
        (["python", "/x/swift/cli/sft.py", "--model", "m"], {}, "node"),
        (["python", "/x/swift/cli/sft.py"], {"LOCAL_RANK": "0", "RANK": "4"}, "node"),
        (["python", "/x/swift/cli/sft.py"], {"LOCAL_RANK": "1", "RANK": "1"}, "trainer"),
        (["python", "train.py"], {}, "node"),
        (
            [
                "python",
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
                "--multiprocessing-fork",
            ],
            {"LOCAL_RANK": "0"},
            "off",
        ),
        (["python", "-m", "torch._inductor.compile_worker", "--workers=4"], {}, "off"),
    ],
)
def test_roles(argv, env, role):
    assert context.decide_role(argv, env) == role


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "trains"),
    [
        (["python", "/v/lib/python3.11/site-packages/swift/cli/sft.py", "--model", "m"], True),
        (["python", "-u", "/v/site-packages/swift/cli/rlhf.py"], True),
        (["python", "/v/site-packages/swift/cli/infer.py"], False),
        (["python", "train.py"], False),  # known once its Trainer is built
    ],
)
def test_training_commands(argv, trains):
    assert context.is_training_command(argv) is trains


@pytest.mark.unit
def test_explicit_role_wins():
    assert context.decide_role(["python", "/venv/bin/swift"], {}, "node") == "node"


@pytest.mark.unit
def test_settings_errors_name_the_variable():
    with pytest.raises(UsageError, match="OTEL_GPU_ROLE='boss': use one of auto, launcher"):
        TracingSettings.load({"OTEL_GPU_ROLE": "boss"})
    with pytest.raises(UsageError, match="OTEL_GPU_STOP_SYNC_STEPS='0': use 1 or more"):
        TracingSettings.load({"OTEL_GPU_STOP_SYNC_STEPS": "0"})
    with pytest.raises(UsageError, match="OTEL_GPU_STOP='maybe': use true or false"):
        TracingSettings.load({"OTEL_GPU_STOP": "maybe"})
    assert TracingSettings.load({}) == TracingSettings()


@pytest.mark.unit
def test_run_context_is_chosen_once_and_joins_an_outer_trace():
    env: dict[str, str] = {}
    first = context.ensure_run_context(env)
    assert env["OTEL_GPU_TRAIN_TRACEPARENT"] == context.format_traceparent(
        first.trace_id, first.span_id
    )
    assert context.ensure_run_context(env) == first  # a child keeps its launcher's choice
    outer = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    joined = context.ensure_run_context({"TRACEPARENT": outer})
    assert joined.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert joined.span_id != 0xB7AD6B7169203331
    assert context.parse_traceparent("00-zz-01") is None


@pytest.mark.unit
def test_ids_ignore_a_seeded_random_module():
    gen = ids.PresetIdGenerator()
    random.seed(42)
    a = gen.generate_span_id()
    random.seed(42)
    assert gen.generate_span_id() != a  # HF set_seed() made every rank reuse the same ids
    with gen.preset(7, 9):
        assert (gen.generate_trace_id(), gen.generate_span_id()) == (7, 9)
    assert gen.generate_span_id() != 9


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.process
def test_shutdown_is_bounded_with_the_collector_down(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from otel_gpu.tracing import phase, step
            with phase("train"):
                step(1, loss=1.0)
            print("END", time.time(), flush=True)
            """
        )
    )
    env = offline_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        OTEL_EXPORTER_OTLP_TIMEOUT="10",  # the SDK default: each signal alone would retry 10 s
        OTEL_GPU_SHUTDOWN_TIMEOUT="2",
        OTEL_GPU_SIMULATE="steady",
    )
    proc = subprocess.run(
        [INSTRUMENT, PY, str(script)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    done = time.time()
    assert proc.returncode == 0, proc.stderr[-2000:]
    end = float(proc.stdout.split("END")[1])
    assert done - end < 4.0
    assert "not fully flushed" in proc.stderr


@pytest.mark.process
def test_bad_setting_is_one_line_and_the_job_still_runs(tmp_path):
    env = offline_env(OTEL_GPU_ROLE="boss")
    proc = subprocess.run(
        [INSTRUMENT, PY, "-c", "print('job ran')"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stdout == "job ran\n"
    assert proc.stderr.strip().splitlines() == [
        "otel-gpu: error: OTEL_GPU_ROLE='boss': use one of auto, launcher, trainer, node, off; "
        "telemetry is off in this process"
    ]


@pytest.mark.process
def test_settings_are_opentelemetry_instrument_flags():
    out = subprocess.run([INSTRUMENT, "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--gpu_role", "--gpu_stop", "--gpu_stop_sync_steps", "--gpu_step_spans_every"):
        assert flag in out


WORKERS_JOB = """
import os, sys, time
sys.path.insert(0, {tests!r})
from transformers import Trainer
from support.tiny_training import TokenDataset, tiny_llama, training_args

class Slow(TokenDataset):
    def __getitem__(self, i):
        time.sleep(0.05)  # the workers live across several metric export intervals
        return super().__getitem__(i)

args = training_args(sys.argv[1], max_steps=12, eval_strategy="no", save_strategy="no",
                     dataloader_num_workers=2)
Trainer(model=tiny_llama(), args=args, train_dataset=Slow(n=64)).train()
# No signal handler of ours competes with ms-swift's graceful_exit or transformers' jit checkpoint.
import signal
print("DEFAULT_HANDLERS", all(signal.getsignal(s) is signal.SIG_DFL
      for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)))
"""


@pytest.mark.peers
def test_forked_dataloader_workers_add_no_series(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(WORKERS_JOB.format(tests=TESTS))
    with OtlpSink() as sink:
        env = offline_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
            OTEL_METRIC_EXPORT_INTERVAL="200",
            OTEL_GPU_SIMULATE="steady",
            OTEL_GPU_INTERVAL="0.2",
            OTEL_GPU_LOCK_DIR=str(tmp_path),
        )
        proc = subprocess.run(
            [INSTRUMENT, PY, str(script), str(tmp_path / "out")],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        peers = {peer for peer, _ in sink.metric_requests}
        points = sink.points()
    assert "DEFAULT_HANDLERS True" in proc.stdout
    assert len(sink.metric_requests) >= 5
    assert len(peers) == 1  # the workers (forked with the SDK's reader thread) sent nothing
    assert {p.metric for p in points} >= {"training.step", "training.phase", "hw.gpu.utilization"}
    assert max(p.value for p in points if p.metric == "training.step") == 12


@pytest.mark.process
def test_a_process_that_never_trains_reports_no_phase(tmp_path):
    # An inference server or a tool: no training framework imported, so no `load` phase that
    # would hide an idle GPU from the detectors; the node metrics still flow.
    with OtlpSink() as sink:
        env = offline_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
            OTEL_METRIC_EXPORT_INTERVAL="200",
            OTEL_GPU_SIMULATE="steady",
            OTEL_GPU_INTERVAL="0.2",
            OTEL_GPU_LOCK_DIR=str(tmp_path),
        )
        code = "import time; time.sleep(1.5)"
        proc = subprocess.run(
            [INSTRUMENT, PY, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        metrics = {p.metric for p in sink.points()}
    assert "hw.gpu.utilization" in metrics
    assert not {"training.phase", "training.step"} & metrics
    assert not sink.spans()
