"""A bad ``OTEL_GPU_*`` value inside the job never raises into the user's code (issue 18.6).

A real job process calls every API it may use (``otel_gpu.phase()``, ``step()``,
``request_stop()``, the explicit HF Trainer callback and its hooks,
``lightning_callback.make_callback()``), with and without ``opentelemetry-instrument``
(the distro): it exits 0, stderr holds exactly one line ("...; telemetry is off in this
process") and no span is recorded, even through the user's own tracer provider."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.tiny_training import offline_env

pytestmark = pytest.mark.peers  # ~15 s a job: torch, transformers and lightning load in each

INSTRUMENT = str(Path(sys.executable).with_name("opentelemetry-instrument"))

JOB = r"""
import json, types
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
provider = TracerProvider(resource=Resource.get_empty())  # the user's own SDK
provider.add_span_processor(SimpleSpanProcessor(exporter))
if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
    trace.set_tracer_provider(provider)

import otel_gpu
from otel_gpu.tracing.hf_callback import OtelGpuTrainerCallback
from otel_gpu.tracing.lightning_callback import make_callback

with otel_gpu.phase("load"):
    pass
with otel_gpu.phase("train"):
    for n in (1, 2, 3):
        assert otel_gpu.step(n, loss=1.0 / n) is False
        with otel_gpu.phase("evaluate"):
            pass
otel_gpu.request_stop("a test")
assert otel_gpu.current_step() in (None, 3)

args = types.SimpleNamespace(output_dir="out", num_train_epochs=1,
                             per_device_train_batch_size=2, gradient_accumulation_steps=1)
state = types.SimpleNamespace(global_step=0, max_steps=2, epoch=0)
control = types.SimpleNamespace(should_save=False, should_training_stop=False)
hf = OtelGpuTrainerCallback(tracer_provider=provider)
hf.on_train_begin(args, state, control)
for s in (1, 2):
    hf.on_step_begin(args, state, control)
    state.global_step = s
    hf.on_step_end(args, state, control)
    hf.on_log(args, state, control, logs={"loss": 0.5})
hf.on_train_end(args, state, control)
lightning = make_callback()
print(json.dumps({"spans": sorted(s.name for s in exporter.get_finished_spans()),
                  "stop": control.should_training_stop, "lightning": type(lightning).__name__}))
"""

IN_JOB = {  # every setting phase(), step() and the callbacks read
    "OTEL_GPU_ROLE": ("bogus", "use one of auto, launcher, trainer, node, off"),
    "OTEL_GPU_STEP_SPANS_EVERY": ("-1", "use 0 or more"),
    "OTEL_GPU_STOP": ("maybe", "use true or false"),
    "OTEL_GPU_STOP_SYNC_STEPS": ("0", "use 1 or more"),
}
AGENT = {  # what the distro reads besides: the in-process node agent's, its detection's
    "OTEL_GPU_INTERVAL": "fast",
    "OTEL_GPU_DETECT": "sometimes",
    "OTEL_GPU_DETECT_STALL_WINDOW_S": "-5",
}


def _job(tmp_path: Path, instrumented: bool, **setting: str) -> tuple[dict, list[str]]:
    script = tmp_path / "train.py"
    script.write_text(JOB)
    argv = [sys.executable, str(script)]
    env = offline_env(
        OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
        OTEL_GPU_SIMULATE="steady", OTEL_GPU_LOCK_DIR=str(tmp_path), **setting,
    )  # fmt: skip
    proc = subprocess.run(
        [INSTRUMENT, *argv] if instrumented else argv,
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr.strip().splitlines()


def _off_line(variable: str, value: str, accepted: str) -> str:
    return f"otel-gpu: error: {variable}={value!r}: {accepted}; telemetry is off in this process"


def test_good_settings_record_spans(tmp_path: Path) -> None:
    # The control: the same job with valid settings records spans, says nothing.
    out, err = _job(tmp_path, instrumented=False, OTEL_GPU_STEP_SPANS_EVERY="1")
    assert err == []
    assert {"train", "step", "evaluate", "load"} <= set(out["spans"]), out


@pytest.mark.parametrize("instrumented", [False, True], ids=["plain", "instrumented"])
@pytest.mark.parametrize("variable", sorted(IN_JOB))
def test_a_bad_value_is_one_line_and_no_telemetry(
    tmp_path: Path, variable: str, instrumented: bool
) -> None:
    value, accepted = IN_JOB[variable]
    out, err = _job(tmp_path, instrumented, **{variable: value})
    assert err == [_off_line(variable, value, accepted)]
    assert out == {"spans": [], "stop": False, "lightning": "OtelGpuLightningCallback"}


@pytest.mark.parametrize("variable", sorted(AGENT))
def test_a_bad_agent_value_under_the_distro_is_one_line_and_no_telemetry(
    tmp_path: Path, variable: str
) -> None:
    out, err = _job(tmp_path, instrumented=True, **{variable: AGENT[variable]})
    assert len(err) == 1 and err[0].startswith(f"otel-gpu: error: {variable}="), err
    assert err[0].endswith("; telemetry is off in this process")
    assert out["spans"] == [] and out["stop"] is False
