"""A tiny data-parallel job (torchrun, gloo, CPU) whose ranks compute for a set time per step,
for the straggler tests (issue 22 §2). ``python -m torch.distributed.run --nproc-per-node N
straggler_job.py MODE``; every step a rank computes (sleeps ``STRAGGLER_JOB_STEP_S``, default
0.05 s), all-reduces a 4-float tensor (where the fast ranks wait for a slow one) and ends the
step (``otel_gpu.step``), for ``STRAGGLER_JOB_S`` seconds (default 30), by MODE:

- ``one``: rank 2 computes 3x longer from ``STRAGGLER_JOB_SLOW_AFTER_S`` (default 12) on;
- ``rare``: rank 1 computes 5x longer in one step of 20;
- ``all``: every rank computes 3x longer from ``STRAGGLER_JOB_SLOW_AFTER_S`` on.

A rank that starts computing longer prints ``rank R slow from WALL_TIME`` once.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import otel_gpu

STEP_S = float(os.environ.get("STRAGGLER_JOB_STEP_S", "0.05"))
RUN_S = float(os.environ.get("STRAGGLER_JOB_S", "30"))
SLOW_AFTER_S = float(os.environ.get("STRAGGLER_JOB_SLOW_AFTER_S", "12"))


def compute_s(mode: str, rank: int, step: int, elapsed: float) -> float:
    late = elapsed >= SLOW_AFTER_S
    if mode == "one" and rank == 2 and late:
        return 3 * STEP_S
    if mode == "rare" and rank == 1 and step % 20 == 0:
        return 5 * STEP_S
    if mode == "all" and late:
        return 3 * STEP_S
    return STEP_S


def main() -> int:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.barrier()  # every rank starts its clock together
    started = time.monotonic()
    announced = False
    with otel_gpu.phase("train"):
        step = 0
        while True:
            elapsed = time.monotonic() - started
            done = torch.tensor([1.0 if elapsed >= RUN_S else 0.0])
            dist.all_reduce(done)  # all ranks stop at the same step
            if done.item() > 0:
                break
            step += 1
            seconds = compute_s(mode, rank, step, elapsed)
            if seconds > STEP_S and mode != "rare" and not announced:
                print(f"rank {rank} slow from {time.time():.3f}", flush=True)
                announced = True
            time.sleep(seconds)  # the step's compute
            dist.all_reduce(t)  # the gradients: the fast ranks wait here for a slow one
            otel_gpu.step(step)
    print(f"rank {rank} done after {step} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
