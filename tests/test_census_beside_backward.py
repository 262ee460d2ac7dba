"""A census beside a real CPU training loop never crashes it (the job is sacred).

Reading a parameter's ``.grad`` or the tensors an autograd graph saves while backward runs on
another thread (with the GIL released) crashed the process with SIGSEGV within seconds; the
census reads neither. The loop runs in a child process, so a crash fails this test, not the
test worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers  # imports torch in a child and trains for seconds

LOOP = textwrap.dedent(
    """
    import faulthandler, threading, time
    faulthandler.enable()
    import torch
    from otel_gpu.diagnose import census

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept = []  # outputs kept with their graphs, never backpropagated (a leak's shape)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            x = torch.randn(32, 64)
            out = model(x)
            out.relu_()  # in place on a non-leaf: its grad_fn is rebased while censuses read it
            loss = out.pow(2).mean()
            kept.append(model(x).sum())
            del kept[:-50]
            opt.zero_grad()
            loss.backward()
            opt.step()

    trainer = threading.Thread(target=train)
    trainer.start()
    end = time.monotonic() + SECONDS
    n = 0
    while time.monotonic() < end:
        c = census.take(census.Bounds(max_s=2))
        n += 1
    stop.set()
    trainer.join()
    [held] = [h for p, h in c.holders.items() if p.endswith(".kept")]
    print(n, held.count, held.grad_fn)
    """
)


def test_censuses_beside_backward_leave_the_training_loop_running(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"  # a file of the program's own: its globals are roots
    script.write_text(LOOP.replace("SECONDS", "12"))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    censuses, count, grad_fn = map(int, proc.stdout.split())
    assert censuses >= 10  # many censuses overlapped many backward passes
    assert count == grad_fn > 0  # the kept outputs are named, their graphs seen
