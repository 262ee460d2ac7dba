"""Peak memory of `otel-gpu analyze` on a large trace, streamed, beside loading it whole.

    python benchmarks/bench_analyze_memory.py [--rows N]

Writes a trace of N rows (a job's memory creeping up with noise, ~45 bytes a row) and, for N/4
and N rows, measures the peak RSS of fresh processes on it: the streamed reading `analyze`
does (one row in memory at a time) and the baseline, the way analyze read a file before (every
row parsed into a list, then replayed), with the same imports and the same engine, so the
difference is the rows held; and `otel-gpu analyze FILE` itself (the command line's imports
on top). Prints MiB per size and ends with
one JSON line {"name", "value", "baseline", "ratio", "unit"} for N rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Runs one command and prints the peak RSS (KiB on Linux) of that child alone.
PEAK = (
    "import resource, subprocess, sys\n"
    "res = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
    "assert res.returncode == 0, res.stderr.decode()[-2000:]\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)
# The previous analyze: the whole file as a list of rows, then the replay; and the streamed
# one with the same imports (the command line itself is measured too).
LOADED = (
    "import sys\n"
    "from otel_gpu.detect.engine import DetectConfig, Engine\n"
    "from otel_gpu.detect.trace import read_rows, replay_rows, subject_for\n"
    "rows = read_rows(sys.argv[1])\n"
    "alerts = replay_rows(Engine(DetectConfig()), subject_for(sys.argv[1]), rows)\n"
    "print(len(rows), len(alerts))\n"
)
STREAMED = (
    "import sys\n"
    "from otel_gpu.detect.engine import DetectConfig, Engine\n"
    "from otel_gpu.detect.trace import iter_rows, replay_iter, subject_for\n"
    "rows = iter_rows(sys.argv[1])\n"
    "alerts = replay_iter(Engine(DetectConfig()), subject_for(sys.argv[1]), rows)\n"
    "print(sum(1 for _ in alerts))\n"
)


def write_trace(path: Path, rows: int) -> None:
    rng = random.Random(7)
    limit = 80 * 2**30
    with path.open("w") as fh:
        fh.write("time_s,used_bytes,limit_bytes,util\n")
        for i in range(rows):
            used = 30 * 2**30 + 1400 * i + rng.randint(0, 2**24)
            fh.write(f"{i * 5},{used},{limit},{rng.uniform(0.85, 0.99):.3f}\n")


def peak_mib(command: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", PEAK, *command],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    return int(out.stdout.split()[-1]) / 1024


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the larger trace")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rows in (args.rows // 4, args.rows):
            path = Path(tmp) / f"trace-{rows}.csv"
            write_trace(path, rows)
            size = path.stat().st_size / 2**20
            command = peak_mib([sys.executable, "-m", "otel_gpu.cli", "analyze", str(path)])
            streamed = peak_mib([sys.executable, "-c", STREAMED, str(path)])
            loaded = peak_mib([sys.executable, "-c", LOADED, str(path)])
            results[rows] = (streamed, loaded)
            print(
                f"{rows:>9} rows ({size:.0f} MiB of CSV): streamed {streamed:.0f} MiB peak RSS, "
                f"baseline (whole file loaded) {loaded:.0f} MiB; `otel-gpu analyze` {command:.0f} MiB"
            )
    small, large = results[args.rows // 4], results[args.rows]
    print(
        f"growth from {args.rows // 4} to {args.rows} rows: streamed {large[0] - small[0]:+.0f} "
        f"MiB, baseline {large[1] - small[1]:+.0f} MiB"
    )
    value, baseline = large
    print(
        json.dumps(
            {
                "name": f"analyze_peak_rss_{args.rows}_rows",
                "value": round(value, 1),
                "baseline": round(baseline, 1),
                "ratio": round(value / baseline, 3),
                "unit": "MiB",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
