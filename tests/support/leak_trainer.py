"""The planted-leak trainer (tests/support/leak_shapes/train.py) as a running child process
with the in-process part (``opentelemetry-instrument``), for memory attribution tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = Path(__file__).resolve().parent / "leak_shapes"

# The holder each planted leak is named by (train.py's docstring), and a word of its shape.
LEAK_HOLDERS = {
    "loss with its graph in a list": "losses",
    "activations in a module attribute": "train.model.encoder._cache",
    "dict keyed by step": "train.inputs_by_step",
    "forward hook closure": "train.model.head._forward_hooks[*] → make_recorder.<locals>.outs",
    "module-level cache": "leakylib._FEATURES",
    "logging callback": "train.callbacks[*].seen",
}


def trainer_env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OTEL_GPU_RUNTIME_DIR": str(runtime_dir),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_GPU_DETECT": "false",
        "OTEL_GPU_ROLE": "trainer",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


@contextlib.contextmanager
def running_trainer(mode: str, runtime_dir: Path, **env: str) -> Iterator[subprocess.Popen[str]]:
    """The trainer in ``mode`` (``leaks`` or ``benign``), past its warm-up steps; it stops
    when the block ends (its standard input closes)."""
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    proc = subprocess.Popen(
        [instrument, sys.executable, str(SHAPES / "train.py"), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=trainer_env(runtime_dir, **env), cwd=str(SHAPES),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "ready", proc.stderr.read() if proc.stderr else line
        yield proc
    finally:
        died = proc.poll()  # before the block asked it to stop
        try:
            _out, err = proc.communicate("\n", timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
        if died is not None or proc.returncode != 0:
            # shown with a failing test: a trainer that died under it (a crash in a census?)
            print(f"trainer exited {proc.returncode} (before the end: {died is not None})")
            print((err or "")[-4000:])
