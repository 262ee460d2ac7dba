"""Detection engine cost per sample, beside the cost of just handing the points over.

    python benchmarks/bench_engine.py [--subjects N] [--hours H]

Replays generated traces (every benign shape, leaks and stalls, 5-60 s intervals) for N
subjects interleaved in time, as a processor sees them. The baseline, measured in the same
run over the same points, is a minimal adapter: per point, look the subject up in a dict and
keep its latest time. Prints both in microseconds per sample, the engine's state size, and
ends with one JSON line {"name", "value", "baseline", "ratio", "unit"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.tracegen import BENIGN, FAULTS, generate  # noqa: E402

from otel_gpu.detect.engine import Engine  # noqa: E402
from otel_gpu.detect.model import Point  # noqa: E402


def build(subjects: int, hours: float) -> list[tuple[str, Point]]:
    shapes = BENIGN + FAULTS
    streams = []
    for i in range(subjects):
        shape = shapes[i % len(shapes)]
        interval = (5.0, 15.0, 30.0, 60.0)[i % 4]
        tr = generate(
            shape,
            seed=i,
            interval_s=interval,
            duration_s=hours * 3600,
            noise=("nvml", "inproc")[i % 2],
            rate_mb_per_h=60 + 100 * (i % 7),
        )
        streams.extend((p.time, i, f"process:{1000 + i}@GPU-{i % 8}", p) for p in tr.points)
    streams.sort(key=lambda x: (x[0], x[1]))
    return [(s, p) for _, _, s, p in streams]


class _Adapter:
    """The floor: what any per-subject consumer pays to receive a point."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def observe(self, subject: str, point: Point) -> list[object]:
        self.last[subject] = point.time
        return []


def measure(points: list[tuple[str, Point]], sink: object) -> float:
    observe = sink.observe  # type: ignore[attr-defined]
    start = time.perf_counter()
    for subject, point in points:
        observe(subject, point)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subjects", type=int, default=200)
    ap.add_argument("--hours", type=float, default=3.0)
    args = ap.parse_args(argv)
    points = build(args.subjects, args.hours)
    n = len(points)
    baseline = min(measure(points, _Adapter()) for _ in range(3)) / n * 1e6
    engine_times = []
    alerts = 0
    for _ in range(2):
        engine = Engine()
        engine_times.append(measure(points, engine) / n * 1e6)
    engine = Engine()
    for s, p in points:
        alerts += len(engine.observe(s, p))
    tracemalloc.start()
    sized = Engine()
    for s, p in points:
        sized.observe(s, p)
    state_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    value = min(engine_times)
    print(f"points: {n} from {args.subjects} subjects over {args.hours:g} h of data time")
    print(f"baseline (dict adapter): {baseline:.2f} us/sample")
    print(f"engine.observe:          {value:.2f} us/sample ({1e6 / value:,.0f} samples/s/core)")
    print(f"alerts raised: {alerts}")
    print(f"engine state: {state_bytes / args.subjects / 1024:.1f} KiB per subject")
    print(
        json.dumps(
            {
                "name": "engine_cost_per_sample",
                "value": round(value, 3),
                "baseline": round(baseline, 3),
                "ratio": round(value / baseline, 2),
                "unit": "us/sample",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
