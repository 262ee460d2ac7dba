"""What the wrapper–trainer join (otel_gpu/agent/trainers.py) costs the sampler thread per
sweep, beside the same sweep's detection.

    python benchmarks/bench_trainer_poll.py [--trainers 8] [--sweeps 200]

T trainers serve real control sockets (the in-process part's ``hello`` and ``progress``
handlers, on their own threads in this process, each with a step ring that grows by 10 steps
between sweeps); each sweep polls them all (one directory read, ``progress`` with the cursor).
The baseline, measured in the same run on the same snapshots: the watchdog's detection of a
node of 8 GPUs and 64 GPU processes. Ends with one JSON line {"name", "value", "baseline",
"ratio", "unit"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from otel_gpu.agent.trainers import TrainerProgress
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.core.channel import ControlServer, socket_path
from otel_gpu.detect.breaker import Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

GIB = 1 << 30


class Ring:
    """A trainer's progress as the in-process part answers it."""

    def __init__(self) -> None:
        self.ends: list[list[float]] = []

    def advance(self, steps: int) -> None:
        for _ in range(steps):
            n = len(self.ends) + 1
            self.ends.append([n, n, time.time()])

    def progress(self, request: Any) -> dict[str, Any]:
        since = request.get("since", 0)
        fresh = [e for e in self.ends[-1024:] if e[0] > since]
        return {"phase": "train", "step": len(self.ends), "seq": len(self.ends), "steps": fresh,
                "lost": 0, "numbers": {"loss": 0.5, "step_s": 0.1}}  # fmt: skip


def node(t: float, pids: list[int]) -> Snapshot:
    uuids = [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(8)]
    return Snapshot(
        time=t,
        gpus=tuple(
            GpuSample(
                u, i, memory_used=40 * GIB, memory_total=80 * GIB, util_gpu=0.9, power_w=500.0
            )
            for i, u in enumerate(uuids)
        ),  # fmt: skip
        gpu_processes=tuple(
            GpuProcessSample(10_000 + i, uuids[i % 8], used_memory=GIB) for i in range(64)
        ),
        processes=tuple(ProcessSample(pid, memory_rss=GIB) for pid in pids),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--sweeps", type=int, default=200)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="otel-gpu-bench-")
    pids = [100_000 + i for i in range(args.trainers)]
    rings = [Ring() for _ in pids]
    servers = [
        ControlServer(
            socket_path(directory, pid),
            {
                "hello": lambda _r, pid=pid: {"pid": pid, "rank": pid % 100},
                "progress": ring.progress,
            },
        )  # fmt: skip
        for pid, ring in zip(pids, rings, strict=True)
    ]
    progress = TrainerProgress(directory)
    watchdog = Watchdog(Engine(), Breaker())
    poll, detect = [], []
    for i in range(args.sweeps):
        for ring in rings:
            ring.advance(10)
        snap = node(1000.0 + 5 * i, [os.getpid(), *pids])
        began = time.perf_counter()
        progress.on_snapshot(snap)
        poll.append(time.perf_counter() - began)
        began = time.perf_counter()
        watchdog.on_snapshot(snap)
        detect.append(time.perf_counter() - began)
    for server in servers:
        server.close()
    summary = progress.summary() or {}
    assert summary.get("step_ends") == 10 * args.sweeps, summary
    p, d = statistics.median(poll) * 1e3, statistics.median(detect) * 1e3
    print(f"join: {args.trainers} trainers polled per sweep, median {p:.2f} ms "
          f"(p95 {sorted(poll)[int(0.95 * len(poll))] * 1e3:.2f} ms); no step lost "
          f"({summary['step_ends']} step ends)", file=sys.stderr)  # fmt: skip
    print(f"baseline: detection of 8 GPUs and 64 GPU processes, median {d:.2f} ms",
          file=sys.stderr)  # fmt: skip
    print(json.dumps({"name": "trainer_poll_ms", "value": round(p, 3), "baseline": round(d, 3),
                      "ratio": round(p / d, 3) if d else None, "unit": "ms/sweep"}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
