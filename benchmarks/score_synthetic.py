"""Score the leak detector on held-out synthetic traces (``tests/support/heldout.py``).

    python benchmarks/score_synthetic.py [--n N] [--seed S] [--verbose]

Draws N traces of each kind (leaks, and every benign kind: curricula, caches and KV caches
filling to a cap, sawtooth, long saves, fragmentation steps, warm-ups) from seeds S, S+1, ...
(default 20 per kind from seed 1000000: none of them was ever tuned on), replays each through a
fresh engine and prints: leak false alarms (any leak alert on a benign trace or before a leak's
onset), leaks missed, detection delays (median, p90, max, and by rate band) and the first
alert's rate error; then one JSON line. Alerts of other kinds (a stall on an unmarked save) are
counted apart: this scores the leak detector. Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.heldout import BENIGN, LEAKS, scenario  # noqa: E402

from otel_gpu.detect.engine import DetectConfig, Engine  # noqa: E402
from otel_gpu.detect.model import LEAK  # noqa: E402
from otel_gpu.detect.trace import replay  # noqa: E402

HELD_OUT_SEED = 1_000_000
BANDS = ((0, 100), (100, 300), (300, 1000), (1000, 1e9))  # MB/h


def score(
    n: int, seed: int, config: DetectConfig | None = None, kinds: tuple[str, ...] = LEAKS + BENIGN
) -> list[dict[str, object]]:
    """One result dict per generated trace."""
    engine = Engine(config or DetectConfig())
    rows: list[dict[str, object]] = []
    for kind in kinds:
        for i in range(n):
            tr = scenario(kind, seed + i)
            alerts = replay(engine, "job:" + tr.name, tr.points)
            leaks = [a for a in alerts if a.kind == LEAK]
            onset = tr.onset_s
            hit = next((a for a in leaks if onset is not None and a.time >= onset), None)
            false = [a.time for a in leaks if onset is None or a.time < onset]
            rows.append(
                {
                    "trace": tr.name,
                    "kind": kind,
                    "onset_s": onset,
                    "rate_true": tr.rate_bytes_per_s,
                    "first_alert_s": hit.time if hit else None,
                    "delay_s": None if hit is None or onset is None else hit.time - onset,
                    "rate_est": hit.rate_bytes_per_s if hit else None,
                    "false_alarms": false,
                    "other_alerts": [a.kind for a in alerts if a.kind != LEAK],
                }
            )
    return rows


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="traces per kind (default 20)")
    ap.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="first seed")
    ap.add_argument("--verbose", action="store_true", help="one line per trace")
    args = ap.parse_args(argv)
    rows = score(args.n, args.seed)
    if args.verbose:
        for r in rows:
            delay = "-" if r["delay_s"] is None else f"{r['delay_s'] / 60:.0f}min"  # type: ignore[operator]
            rate = "" if r["rate_true"] is None else f"{r['rate_true'] * 3.6e-3:.0f}MB/h"  # type: ignore[operator]
            fa = ",".join(f"{t:.0f}" for t in r["false_alarms"]) or "-"  # type: ignore[attr-defined]
            print(f"{r['trace']:34} {rate:>9} {delay:>7}  false@{fa}")
    leaks = [r for r in rows if r["kind"] in LEAKS]
    benign = [r for r in rows if r["kind"] not in LEAKS]
    delays = [r["delay_s"] / 60 for r in leaks if r["delay_s"] is not None]  # type: ignore[operator]
    missed = [r["trace"] for r in leaks if r["delay_s"] is None]
    false_benign = Counter(r["kind"] for r in benign if r["false_alarms"])
    false_early = sum(1 for r in leaks if r["false_alarms"])
    errors = [
        abs(r["rate_est"] / r["rate_true"] - 1)  # type: ignore[operator]
        for r in leaks
        if r["rate_est"] is not None and r["rate_true"]
    ]
    other = Counter(k for r in rows for k in r["other_alerts"])  # type: ignore[attr-defined]
    print(f"held-out synthetic traces: {args.n} per kind from seed {args.seed}")
    print(
        f"benign: {len(benign)} traces, {sum(false_benign.values())} with a leak false alarm"
        f" {dict(false_benign) or ''}"
    )
    print(f"leaks: {len(leaks)} traces, {len(missed)} missed, {false_early} alerted before onset")
    if delays:
        print(
            f"delay: median {statistics.median(delays):.0f} min, p90 {_q(delays, 0.9):.0f} min,"
            f" max {max(delays):.0f} min"
        )
    for low, high in BANDS:
        band = [
            r["delay_s"] / 60  # type: ignore[operator]
            for r in leaks
            if r["delay_s"] is not None and low <= r["rate_true"] * 3.6e-3 < high  # type: ignore[operator]
        ]
        if band:
            print(
                f"  {low:>4.0f}-{high:<5.0f} MB/h: {len(band):3} found,"
                f" median {statistics.median(band):.0f} min"
            )
    if errors:
        print(
            f"rate error of the first alert: median {statistics.median(errors):.0%},"
            f" max {max(errors):.0%}"
        )
    if other:
        print(f"other alerts (not scored): {dict(other)}")
    print(
        json.dumps(
            {
                "name": "synthetic_leak_median_delay_min",
                "value": statistics.median(delays) if delays else None,
                "unit": "min",
                "false_alarms": sum(false_benign.values()) + false_early,
                "missed": len(missed),
                "traces": len(rows),
                "seed": args.seed,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
