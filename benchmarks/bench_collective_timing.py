"""Cost of the collective timing (``otel_gpu/tracing/collective_timing.py``): a real gloo
process group of one rank (CPU, a TCP store on 127.0.0.1) running ``all_reduce`` on a 4-float
tensor with and without the wrapper, alternating rounds in the same run (best of five each), the
wrapper alone (around a collective that returns at once), and a step of the in-process part (``progress.set_step``, which splits the step into wait and
work) with and without timed collectives behind it.

    python benchmarks/bench_collective_timing.py [--calls N]

Prints the time per call and per step side by side and ends with one JSON line {"name",
"value", "baseline", "ratio", "unit"} (per all_reduce call, in microseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from otel_gpu.tracing import collective_timing, progress  # noqa: E402


def per_call(calls: int, t: torch.Tensor) -> float:
    all_reduce = dist.all_reduce  # as user code calls it: the module's attribute, now
    started = time.perf_counter()
    for _ in range(calls):
        all_reduce(t)
    return (time.perf_counter() - started) / calls


def no_op(tensor, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """A collective that returns at once: the wrapper's own cost, without gloo's noise."""
    return None


def per_no_op(calls: int, call) -> float:  # type: ignore[no-untyped-def]  # noqa: ANN001
    started = time.perf_counter()
    for _ in range(calls):
        call(None)
    return (time.perf_counter() - started) / calls


def per_step(steps: int) -> float:
    first = progress.current_step() or 0
    started = time.perf_counter()
    for n in range(first + 1, first + steps + 1):
        progress.set_step(n)
    return (time.perf_counter() - started) / steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(4)
    per_call(200, t)  # warm-up
    plain, timed = [], []
    for _ in range(5):
        plain.append(per_call(args.calls, t))
        collective_timing.install()
        timed.append(per_call(args.calls, t))
        collective_timing.uninstall()
    wrapped = collective_timing.timed(no_op, 3, collective_timing._compiling())
    bare = min(per_no_op(args.calls * 10, no_op) for _ in range(5))
    own = min(per_no_op(args.calls * 10, wrapped) for _ in range(5))
    steps_plain = per_step(args.calls)  # no collective timed: the split is not computed
    collective_timing.install()
    dist.all_reduce(t)
    steps_timed = per_step(args.calls)
    calls, waited = collective_timing.totals()
    collective_timing.uninstall()
    dist.destroy_process_group()
    base, value = min(plain), min(timed)
    print(f"gloo all_reduce, 1 rank, 4 floats: {base * 1e6:.2f} us plain, "
          f"{value * 1e6:.2f} us timed (+{(value - base) * 1e9:.0f} ns per call)")  # fmt: skip
    print(f"a no-op collective: {bare * 1e9:.0f} ns plain, {own * 1e9:.0f} ns timed "
          f"(+{(own - bare) * 1e9:.0f} ns: the wrapper alone)")  # fmt: skip
    print(f"progress.set_step: {steps_plain * 1e9:.0f} ns without a split, "
          f"{steps_timed * 1e9:.0f} ns with the wait/work split "
          f"(+{(steps_timed - steps_plain) * 1e9:.0f} ns per step)")  # fmt: skip
    print(f"(timing saw {calls} calls, {waited * 1e3:.1f} ms)")
    print(
        json.dumps(
            {
                "name": "collective_timing_all_reduce_us",
                "value": round(value * 1e6, 3),
                "baseline": round(base * 1e6, 3),
                "ratio": round(value / base, 4),
                "unit": "us",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
