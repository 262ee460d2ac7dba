"""PyTorch Lightning under ``opentelemetry-instrument``: the callback comes from the
``lightning.pytorch.callbacks_factory`` entry point (the script adds none)."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import lightning  # noqa: F401  (a test dependency: fail, never skip)
import pytest
from support.otlp_sink import OtlpSink
from support.tiny_training import offline_env

pytestmark = pytest.mark.peers

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")

JOB = """
import sys, threading
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from otel_gpu.tracing import request_stop

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        if self.trainer.global_step + 1 == STOP_AT:  # during step 2 another thread asks
            t = threading.Thread(target=lambda: print("taken", request_stop("test: stall"), flush=True))
            t.start(); t.join()
        return loss
    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

STOP_AT = int(sys.argv[2])
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
trainer = pl.Trainer(max_steps=6, val_check_interval=3, limit_val_batches=2, accelerator="cpu",
                     default_root_dir=sys.argv[1], logger=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
print("callbacks", [type(c).__name__ for c in trainer.callbacks], flush=True)
"""


def _run(tmp_path, stop_at: int, **env_extra):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    with OtlpSink() as sink:
        env = offline_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, OTEL_GPU_ROLE="trainer", **env_extra
        )
        proc = subprocess.run(
            [INSTRUMENT, sys.executable, str(script), str(tmp_path / "out"), str(stop_at)],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, sink.spans()


def test_lightning_run_is_traced(tmp_path):
    proc, spans = _run(tmp_path, stop_at=-1)
    assert "OtelGpuLightningCallback" in proc.stdout
    names = collections.Counter(s.name for s in spans)
    assert names["train"] == 1 and names["step"] == 6 and names["evaluate"] >= 2
    (train,) = [s for s in spans if s.name == "train"]
    assert train.parent_id == "" and train.attributes["training.framework"] == "lightning"
    assert train.attributes["training.model"] == "Tiny"
    steps = sorted(
        (s for s in spans if s.name == "step"), key=lambda s: s.attributes["training.step"]
    )
    assert [s.attributes["training.step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(s.attributes.get("training.loss"), float) for s in steps)
    saves = [s for s in spans if s.name == "save_checkpoint"]
    assert saves and all(s.attributes["training.checkpoint.path"].endswith(".ckpt") for s in saves)


def test_lightning_requested_stop(tmp_path):
    proc, spans = _run(tmp_path, stop_at=2, OTEL_GPU_STOP="true", OTEL_GPU_STOP_SYNC_STEPS="1")
    assert "taken True" in proc.stdout
    ckpt = tmp_path / "out" / "checkpoints" / "otel-gpu-stop-step=2.ckpt"
    assert ckpt.is_file()
    steps = [s.attributes["training.step"] for s in spans if s.name == "step"]
    assert max(steps) == 2
    events = [e for s in spans for e in s.events if e[0] == "otel_gpu.stop"]
    assert [e[1]["otel_gpu.stop.reason"] for e in events] == ["test: stall"]


def test_disabled_by_name(tmp_path):
    proc, spans = _run(
        tmp_path, stop_at=-1, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="otel_gpu_lightning"
    )
    assert "OtelGpuLightningCallback" not in proc.stdout
    assert not [s for s in spans if s.name == "step"]
