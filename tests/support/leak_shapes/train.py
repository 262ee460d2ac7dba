"""A real torch (CPU) training loop with planted leak shapes (``leaks``) or only benign memory
shapes (``benign``), for memory attribution tests (issue 20 §2-§4). Prints ``ready`` after the
warm-up steps, trains until standard input closes (or ``--steps``), then exits.

Leaks (``leaks``), each its own holder:
  1. ``losses`` in ``train()``: loss tensors appended with their autograd graphs;
  2. ``train.model.encoder._cache``: activations kept in a module attribute;
  3. ``train.inputs_by_step``: a dict keyed by step;
  4. a forward hook's closure ``make_recorder.<locals>.outs`` accumulating outputs;
  5. ``leakylib._FEATURES``: a module-level cache without eviction;
  6. ``train.callbacks[*].seen``: tensors kept by a logging callback.
Benign (both modes): a bounded cache, optimizer state created at step 1, a capped replay
buffer, gradient accumulation over 4 steps.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict, deque

import leakylib
import torch

MODE = sys.argv[1]
LEAKS = MODE == "leaks"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 0  # 0: until stdin closes
PAUSE_S = float(sys.argv[3]) if len(sys.argv) > 3 else 0.003


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)
        self._cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        if LEAKS:
            self._cache.append(h.detach())  # leak 2
        return h


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def make_recorder():  # type: ignore[no-untyped-def]
    outs = []

    def record(_module, _inputs, output):  # type: ignore[no-untyped-def]
        outs.append(output.detach())  # leak 4

    return record


class LossLogger:
    """A logging callback that keeps what it logged."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_step(self, step: int, loss: torch.Tensor) -> None:
        if LEAKS:
            self.seen.append(loss.detach().clone())  # leak 6


torch.manual_seed(0)
torch.set_num_threads(1)  # a tiny model: more threads only contend
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # benign: state made at the first step
callbacks = [LossLogger()]
inputs_by_step: dict[int, torch.Tensor] = {}
recent: OrderedDict[int, torch.Tensor] = OrderedDict()  # benign: bounded cache
replay: deque[torch.Tensor] = deque(maxlen=32)  # benign: capped replay buffer
ACCUMULATE = 4  # benign: gradient accumulation
if LEAKS:
    model.head.register_forward_hook(make_recorder())

done = threading.Event()


def _wait_for_stdin() -> None:
    sys.stdin.readline()
    done.set()


def train() -> None:
    losses = []
    step = 0
    while not done.is_set() and (STEPS == 0 or step < STEPS):
        step += 1
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean() / ACCUMULATE
        loss.backward()
        if step % ACCUMULATE == 0:
            opt.step()
            opt.zero_grad()
        recent[step] = x.sum(1)
        if len(recent) > 8:
            recent.popitem(last=False)
        replay.append(x * 2)
        if LEAKS:
            losses.append(loss)  # leak 1 (with its graph)
            inputs_by_step[step] = x  # leak 3
            leakylib.features(step, x)  # leak 5
        for cb in callbacks:
            cb.on_step(step, loss)
        if step == 50:
            print("ready", flush=True)
        time.sleep(PAUSE_S)


if __name__ == "__main__":
    if STEPS == 0:
        threading.Thread(target=_wait_for_stdin, daemon=True).start()
    train()
