"""Step-time overhead of ``otel_gpu.MemTracker`` sampling every 10 ms, beside the same loop
without it, measured in the same run (alternating, best of three each).

    python benchmarks/bench_memtracker.py [--steps N]

The loop: a small torch (CPU) model's forward, backward and optimizer step. Prints the mean
step time of each and ends with one JSON line {"name", "value", "baseline", "ratio", "unit"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from otel_gpu.tracing.memtracker import MemTracker  # noqa: E402


def loop(steps: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    started = time.perf_counter()
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - started) / steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loop(100)  # warm-up
    plain, tracked = [], []
    for _ in range(3):
        plain.append(loop(args.steps))
        with MemTracker(interval_ms=10) as tracker:
            tracked.append(loop(args.steps))
    base, value = min(plain), min(tracked)
    print(f"step without tracker: {base * 1e6:.1f} us")
    print(f"step with tracker at 10 ms: {value * 1e6:.1f} us ({tracker.samples} samples)")
    print(
        json.dumps(
            {
                "name": "memtracker_step_us_at_10ms",
                "value": round(value * 1e6, 2),
                "baseline": round(base * 1e6, 2),
                "ratio": round(value / base, 3),
                "unit": "us",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
