"""Score the detection engine on labelled traces (default: ../shared/traces/dev, else the copy
in tests/data/dev_traces).

    python benchmarks/score_traces.py [DIR]

DIR holds ``*.csv`` traces and ``labels.json`` ({file: {"kind": "benign"|"leak"|"stall",
"onset_s": ...}}). Prints one row per trace: label, onset, first matching alert, detection
delay and false alarms (any alert on a benign trace, any alert before the onset, any alert
of another kind), then a summary and one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.trace import read_trace, replay, subject_for

ROOT = Path(__file__).resolve().parents[1]


def default_dir() -> Path:
    """The team's shared dev traces beside the checkout, else the copy in tests/data."""
    shared = ROOT.parent / "shared" / "traces" / "dev"
    return shared if (shared / "labels.json").is_file() else ROOT / "tests" / "data" / "dev_traces"


def score(directory: Path, config: DetectConfig | None = None) -> list[dict[str, object]]:
    """One result dict per labelled trace."""
    labels = json.loads((directory / "labels.json").read_text())
    engine = Engine(config or DetectConfig())
    rows: list[dict[str, object]] = []
    for name in sorted(labels):
        label = labels[name]
        kind = label["kind"]
        onset = label.get("onset_s")
        path = directory / name
        alerts = replay(engine, subject_for(path), read_trace(path))
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
    directory = Path(argv[0]) if argv else default_dir()
    if not (directory / "labels.json").is_file():
        print(f"score_traces: {directory}/labels.json not found", file=sys.stderr)
        return 2
    rows = score(directory)
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
    print(f"{ok}/{len(rows)} traces correct")
    print(
        json.dumps(
            {
                "name": "dev_traces_correct",
                "value": ok,
                "baseline": len(rows),
                "ratio": ok / len(rows) if rows else 0.0,
                "unit": "traces",
                "max_delay_s": max(delays) if delays else None,  # type: ignore[type-var]
            }
        )
    )
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
