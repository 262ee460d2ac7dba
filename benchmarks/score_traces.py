"""Score the detection engine on labelled traces (default: ../shared/traces/dev, else the copy
in tests/data/dev_traces).

    python benchmarks/score_traces.py [--steps] [DIR]

DIR holds ``*.csv`` traces and ``labels.json`` ({file: {"kind": "benign"|"leak"|"stall",
"onset_s": ...}}). Prints one row per trace: label, onset, first matching alert, detection
delay and false alarms (any alert on a benign trace, any alert before the onset, any alert
of another kind), then a summary and one JSON line.

``--steps`` gives every trace without a ``step`` column one, as an instrumented trainer would
report it: in the train phase a step per 2 s of busy GPU time (utilization above 0.1,
proportionally: an input-bound job at 30 % steps every ~7 s), none while loading, evaluating,
saving or idle (so none after a stall's onset). It measures the step-aware stall rule on the
same jobs; the step column is derived from the trace's own utilization, not from its label.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import PHASE_TRAIN, Point, canonical_phase
from otel_gpu.detect.trace import read_trace, replay, subject_for

STEP_BUSY_S = 2.0  # --steps: seconds of fully busy GPU per training step

ROOT = Path(__file__).resolve().parents[1]


def default_dir() -> Path:
    """The team's shared dev traces beside the checkout, else the copy in tests/data."""
    shared = ROOT.parent / "shared" / "traces" / "dev"
    return shared if (shared / "labels.json").is_file() else ROOT / "tests" / "data" / "dev_traces"


def with_steps(points: list[Point]) -> list[Point]:
    """``points`` with the step counter an instrumented trainer would report (see --steps)."""
    if any(p.step is not None for p in points):
        return points
    out: list[Point] = []
    step, last_t = 0.0, None
    for p in points:
        phase = canonical_phase(p.phase)
        if last_t is not None and phase in (PHASE_TRAIN, None) and (p.util or 0.0) > 0.1:
            step += (p.util or 0.0) * (p.time - last_t) / STEP_BUSY_S
        last_t = p.time
        q = Point(**{f: getattr(p, f) for f in p.__dataclass_fields__})
        q.step = float(math.floor(step))
        out.append(q)
    return out


def score(
    directory: Path, config: DetectConfig | None = None, steps: bool = False
) -> list[dict[str, object]]:
    """One result dict per labelled trace."""
    labels = json.loads((directory / "labels.json").read_text())
    engine = Engine(config or DetectConfig())
    rows: list[dict[str, object]] = []
    for name in sorted(labels):
        label = labels[name]
        kind = label["kind"]
        onset = label.get("onset_s")
        path = directory / name
        points = read_trace(path)
        alerts = replay(engine, subject_for(path), with_steps(points) if steps else points)
        hit = None
        false_alarms = []
        for a in alerts:
            matches = kind != "benign" and a.kind == kind and onset is not None and a.time >= onset
            if matches and hit is None:
                hit = a
            elif not matches:
                false_alarms.append(f"{a.kind}@{a.time:g}")
        rows.append(
            {
                "trace": name,
                "label": kind,
                "onset_s": onset,
                "first_alert_s": hit.time if hit else None,
                "delay_s": (hit.time - onset) if hit and onset is not None else None,
                "rate_true": label.get("rate_Bps"),
                "rate_est": hit.rate_bytes_per_s if hit else None,
                "false_alarms": false_alarms,
                "ok": (kind == "benign" or hit is not None) and not false_alarms,
            }
        )
    return rows


def main(argv: list[str]) -> int:
    steps = "--steps" in argv
    argv = [a for a in argv if a != "--steps"]
    directory = Path(argv[0]) if argv else default_dir()
    if not (directory / "labels.json").is_file():
        print(f"score_traces: {directory}/labels.json not found", file=sys.stderr)
        return 2
    rows = score(directory, steps=steps)
    print(
        f"{'trace':32} {'label':7} {'onset_s':>8} {'alert_s':>8} {'delay':>8}  rate est/true  false"
    )
    for r in rows:

        def fmt(v: object) -> str:
            return "-" if v is None else f"{v:.0f}"

        rate = ""
        if r["rate_est"] is not None and r["rate_true"]:
            rate = f"{r['rate_est'] / r['rate_true']:.2f}x"  # type: ignore[operator]
        delay = "-" if r["delay_s"] is None else f"{r['delay_s'] / 60:.0f}min"  # type: ignore[operator]
        print(
            f"{r['trace']:32} {r['label']:7} {fmt(r['onset_s']):>8} {fmt(r['first_alert_s']):>8} "
            f"{delay:>8}  {rate:>13}  {','.join(r['false_alarms']) or '-'}"  # type: ignore[arg-type]
        )
    ok = sum(1 for r in rows if r["ok"])
    delays = [r["delay_s"] for r in rows if r["delay_s"] is not None]
    stall_delays = [
        r["delay_s"] for r in rows if r["label"] == "stall" and r["delay_s"] is not None
    ]
    median_stall = statistics.median(stall_delays) if stall_delays else None  # type: ignore[type-var]
    print(f"{ok}/{len(rows)} traces correct{' (steps derived: --steps)' if steps else ''}")
    if median_stall is not None:
        print(f"stall delay: median {median_stall:.0f} s, max {max(stall_delays):.0f} s")  # type: ignore[type-var]
    print(
        json.dumps(
            {
                "name": "dev_traces_correct",
                "value": ok,
                "baseline": len(rows),
                "ratio": ok / len(rows) if rows else 0.0,
                "unit": "traces",
                "max_delay_s": max(delays) if delays else None,  # type: ignore[type-var]
                "median_stall_delay_s": median_stall,
                "steps": steps,
            }
        )
    )
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
