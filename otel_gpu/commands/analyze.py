"""``otel-gpu analyze FILE.csv ...``: replay traces through the detection engine.

Prints one JSON line per alert: ``{"file", "kind", "time_s", "rate_bytes_per_s", "eta_s",
"message"}`` (null when unknown), and for a recording (``--record``, rows with a ``subject``)
``"subject"`` too. The engine is exactly the one the agent and the processor run.
A bad file gets one line naming the file and line on stderr; the other files are still
analyzed and the exit code is 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.trace import TraceError, read_rows, replay_rows, subject_for
from otel_gpu.errors import UsageError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="replay CSV traces through the detection engine; one JSON line per alert",
        description="Replay CSV traces (header time_s,used_bytes,limit_bytes"
        "[,util,procs,phase,power_w,power_limit_w]) or recordings (--record: the same with a "
        "subject column) through the leak, stall, threshold and anomaly detectors and print "
        "one JSON line per alert.",
    )
    p.add_argument("files", nargs="+", metavar="FILE.csv", help="trace files")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="JSON or TOML file of detection settings overriding the defaults and "
        'OTEL_GPU_DETECT_* variables (e.g. {"stall_window_s": 1200})',
    )
    p.set_defaults(func=run)


def load_config(path: str | None) -> DetectConfig:
    """Environment overrides, then the file's (validated; UsageError names the problem)."""
    base = DetectConfig.from_env()
    if path is None:
        return base
    values = _read_settings(path)
    merged = {f: getattr(base, f) for f in base.__dataclass_fields__}
    merged.update({k.lower(): v for k, v in values.items()})
    return DetectConfig.from_mapping(merged, source=path)


def _read_settings(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read ({exc.strerror or exc})") from None
    data: Any
    if path.endswith(".toml"):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise UsageError(f"--config {path}: TOML needs Python >= 3.11; use JSON") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"--config {path}: invalid TOML ({exc})") from None
        data = data.get("detect", data)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"--config {path}:{exc.lineno}: invalid JSON ({exc.msg}); "
                "expected an object of detection settings"
            ) from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected an object of detection settings")
    return data


def run(args: argparse.Namespace) -> int:
    engine = Engine(load_config(args.config))
    failed = False
    out = sys.stdout
    for name in args.files:
        try:
            rows = read_rows(name)
        except TraceError as exc:
            print(f"otel-gpu: error: {exc}", file=sys.stderr)
            failed = True
            continue
        recording = any(row.subject for row in rows)
        for alert in replay_rows(engine, subject_for(name), rows):
            record: dict[str, Any] = {
                "file": name,
                "kind": alert.kind,
                "time_s": alert.time,
                "rate_bytes_per_s": alert.rate_bytes_per_s,
                "eta_s": alert.eta_s,
                "message": alert.message,
            }
            if recording:
                record["subject"] = alert.subject
            out.write(json.dumps(record) + "\n")
        out.flush()
    return 2 if failed else 0
