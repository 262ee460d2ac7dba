"""A tiny data-parallel job (torchrun, gloo, CPU) that hangs in a known way, for the stall
diagnosis tests (issue 21). ``python -m torch.distributed.run --nproc-per-node N hang_job.py
MODE [STEPS]``; every rank trains ``STEPS`` steps (``otel_gpu.step``), prints
``rank R at step S`` and then, by MODE:

- ``blocked``: rank 1 calls ``fetch_remote_shard`` (a fetch that never returns), the others
  wait in ``all_reduce``;
- ``mismatch``: rank 1 calls ``broadcast`` where the others call ``all_reduce``;
- ``dead``: rank 1 exits (code 3), the others wait in ``all_reduce``;
- ``loader``: rank 1's DataLoader worker hangs in ``__getitem__``, the others wait in
  ``all_reduce``;
- ``finish``: nobody hangs; every rank exits 0.

A hung rank waits at most ``HANG_JOB_MAX_S`` (default 120 s), then exits 7. Each step takes
``HANG_JOB_STEP_S`` (default 0), all in the train phase (``otel_gpu.phase("train")``).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import otel_gpu

MAX_S = float(os.environ.get("HANG_JOB_MAX_S", "120"))
STEP_S = float(os.environ.get("HANG_JOB_STEP_S", "0"))


def fetch_remote_shard() -> None:
    deadline = time.monotonic() + MAX_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(7)


class StuckDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        fetch_remote_shard()
        return torch.zeros(1)


def train_step(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def main() -> int:
    with otel_gpu.phase("train"):
        return job()


def job() -> int:
    mode = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=MAX_S))
    rank = dist.get_rank()
    t = torch.ones(4)
    for s in range(1, steps + 1):
        train_step(t)
        time.sleep(STEP_S)
        otel_gpu.step(s)
    print(f"rank {rank} at step {steps}", flush=True)
    if mode != "finish" and rank == 1:
        if mode == "blocked":
            fetch_remote_shard()
        elif mode == "mismatch":
            dist.broadcast(t, src=1)
        elif mode == "dead":
            os._exit(3)
        elif mode == "loader":
            loader = torch.utils.data.DataLoader(StuckDataset(), num_workers=1)
            for _batch in loader:
                pass
    try:
        train_step(t)  # the others wait here for rank 1
    except Exception as exc:
        print(f"rank {rank}: {type(exc).__name__}", flush=True)
        os._exit(7)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
