"""What the live view, the summary and the recorder cost the sampler thread per sweep, beside
the detection they follow.

    python benchmarks/bench_view.py [--gpus 8] [--processes 64] [--sweeps 300]

A node of G GPUs with P GPU processes: each sweep's snapshot goes through the watchdog
(detection: the baseline, measured in the same run on the same snapshots), then through the
three sweep listeners as ``otel-gpu run --record FILE`` wires them: the view's frame, the
summary's accumulation and the recorder's rows (queued; the writer thread's disk I/O is not
on the sampler thread and not counted). Drawing happens on the view's own thread; its cost per
frame is printed too. Ends with one JSON line {"name", "value", "baseline", "ratio", "unit"}.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time

from rich.console import Console

from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.detect.breaker import Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.outputs.record import rows
from otel_gpu.outputs.summary import RunSummary
from otel_gpu.outputs.sweeps import Sweep, labels
from otel_gpu.outputs.view.frame import build_frame
from otel_gpu.outputs.view.render import table
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

GIB = 1 << 30


def snapshot(t: float, gpus: int, processes: int) -> Snapshot:
    uuids = [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(gpus)]
    return Snapshot(
        time=t,
        gpus=tuple(
            GpuSample(
                u,
                i,
                "NVIDIA H100 80GB HBM3",
                memory_used=40 * GIB + int(t) * 1000,
                memory_total=80 * GIB,
                util_gpu=0.9,
                power_w=600.0,
                power_limit_w=700.0,
                temperature_c=70.0,
                processes_listed=True,
            )
            for i, u in enumerate(uuids)
        ),  # fmt: skip
        gpu_processes=tuple(
            GpuProcessSample(1000 + p, uuids[p % gpus], used_memory=GIB + int(t) * 100)
            for p in range(processes)
        ),
        processes=tuple(
            ProcessSample(
                1000 + p, executable_name="python", cpu_utilization=0.9, memory_rss=2 * GIB
            )
            for p in range(processes)
        ),  # fmt: skip
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--processes", type=int, default=64)
    ap.add_argument("--sweeps", type=int, default=300)
    args = ap.parse_args(argv)
    snaps = [snapshot(5.0 * i, args.gpus, args.processes) for i in range(args.sweeps)]
    watchdog = Watchdog(Engine(), Breaker())
    summary = RunSummary()
    named: dict[str, str] = {}
    sweeps: list[Sweep] = []
    watchdog.sweep_listeners.append(
        lambda snap, points: sweeps.append(Sweep(snap, points, watchdog.engine, watchdog.breaker))
    )
    detect, follow = [], []
    for snap in snaps:
        began = time.perf_counter()
        watchdog.on_snapshot(snap)
        mid = time.perf_counter()
        sweep = sweeps[-1]
        build_frame(sweep, snaps[0].time)
        names = labels(snap)
        for subject, point in sweep.points:
            summary.observe(subject, point, names.get(subject))
        summary.take_trends(sweep.engine)
        rows(sweep, named)
        follow.append(time.perf_counter() - mid)
        detect.append(mid - began)
    console = Console(file=io.StringIO(), width=80, force_terminal=True)
    frame = build_frame(sweeps[-1], snaps[0].time)
    draws = []
    for _ in range(50):
        began = time.perf_counter()
        with console.capture():
            console.print(table(frame, "otel-gpu run python"))
        draws.append(time.perf_counter() - began)
    value = statistics.median(follow) * 1e3
    baseline = statistics.median(detect) * 1e3
    print(f"{args.gpus} GPUs x {args.processes} GPU processes, {args.sweeps} sweeps")
    print(f"baseline (watchdog: detection on the sweep): {baseline:.3f} ms/sweep")
    print(f"view frame + summary + recorder rows:         {value:.3f} ms/sweep")
    print(f"drawing one frame (view thread, not sampler): {statistics.median(draws) * 1e3:.3f} ms")
    print(
        json.dumps(
            {
                "name": "view_summary_record_cost_per_sweep",
                "value": round(value, 3),
                "baseline": round(baseline, 3),
                "ratio": round(value / baseline, 2),
                "unit": "ms/sweep",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
