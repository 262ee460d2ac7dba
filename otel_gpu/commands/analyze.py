"""``otel-gpu analyze FILE.csv ...``: replay traces through the detection engine.

Prints one JSON line per alert: ``{"file", "kind", "time_s", "rate_bytes_per_s", "eta_s",
"message"}`` (null when unknown), and for a recording (``--record``, rows with a ``subject``)
``"subject"`` too. The engine is exactly the one the agent and the processor run.
A file is streamed (one row in memory at a time; each alert printed when it is raised), so a
file of any size is read in flat memory. A bad file gets one line naming the file and line on
stderr (alerts of the rows before it are printed already); the other files are still analyzed
and the exit code is 2.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from otel_gpu.commands.common import add_command
from otel_gpu.core.settings import read_settings_file
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.trace import COLUMNS, Row, TraceError, iter_rows, replay_iter, subject_for


def add_parser(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "analyze",
        "replay CSV traces through the detection engine; one JSON line per alert",
        """Replay CSV traces (header
        time_s,used_bytes,limit_bytes[,util,procs,phase,power_w,power_limit_w]) or
        recordings (--record: the same with a subject column) through the leak,
        stall, threshold and anomaly detectors and print one JSON line per alert.""",
    )
    p.add_argument(
        "files", nargs="+", metavar="FILE.csv", help="trace files; - reads standard input"
    )
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
    data = read_settings_file(path, "--config", "detection settings")
    if path.lower().endswith(".toml"):
        data = data.get("detect", data)  # a [detect] table, or the settings at the top
    return data


def _after_first(rows: Iterator[Any], then: Callable[[], None]) -> Iterator[Any]:
    """``rows``, calling ``then`` once the first one has been read."""
    first = True
    for row in rows:
        if first:
            first = False
            then()
        yield row


def run(args: argparse.Namespace) -> int:
    engine = Engine(load_config(args.config))
    failed = False
    out = sys.stdout
    warned: set[str] = set()

    for name in args.files:
        # Said once the file reads as a trace: a file that is no CSV at all (analyze train.py)
        # gets its one error line, not first a warning about its "columns".
        pending: list[str] = []

        def unknown(columns: list[str], name: str = name, pending: list[str] = pending) -> None:
            new = [c for c in columns if c not in warned]
            warned.update(new)
            pending.extend(new)

        def say_unknown(name: str = name, pending: list[str] = pending) -> None:
            if pending:
                print(
                    f"otel-gpu: warning: {name}: ignoring column(s) {', '.join(pending)}; the "
                    f"detectors read {', '.join(COLUMNS)}",
                    file=sys.stderr,
                )
                pending.clear()

        # Streamed: one row in memory at a time, each alert printed when it is raised.
        span = _Span()
        alerts = 0
        try:
            rows = iter_rows(name, stream=_stdin() if name == "-" else None, on_unknown=unknown)
            for row, alert in replay_iter(
                engine, subject_for(name), span.count(_after_first(rows, say_unknown))
            ):
                alerts += 1
                record: dict[str, Any] = {
                    "file": name,
                    "kind": alert.kind,
                    "time_s": alert.time,
                    "rate_bytes_per_s": alert.rate_bytes_per_s,
                    "eta_s": alert.eta_s,
                    "message": alert.message,
                }
                if row.subject is not None:  # a recording: which of its series
                    record["subject"] = alert.subject
                out.write(json.dumps(record) + "\n")
        except TraceError as exc:
            out.flush()
            what = f"{name} is not a CSV trace or recording: " if pending else ""
            print(f"otel-gpu: error: {what}{exc}", file=sys.stderr)
            failed = True
            continue
        say_unknown()
        out.flush()
        print(f"otel-gpu: {span.summary(name, alerts)}", file=sys.stderr)
    return 2 if failed else 0


def _stdin() -> TextIO:
    """Standard input as the CSV reader wants it: UTF-8 (BOM dropped), line ends untranslated."""
    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", newline="")


class _Span:
    """How many rows a file held and the data times they span, counted as they pass."""

    def __init__(self) -> None:
        self.n = 0
        self.first = self.last = 0.0

    def count(self, rows: Iterator[Row]) -> Iterator[Row]:
        for row in rows:
            if self.n == 0:
                self.first = row.point.time
            self.n += 1
            self.last = row.point.time
            yield row

    def summary(self, name: str, alerts: int) -> str:
        """One line per file: samples, the time they span, and the alerts found."""
        if not self.n:
            return f"{name}: no samples, 0 alerts"
        first, last = self.first, self.last
        return (
            f"{name}: {self.n} samples, {first:g}..{last:g} s ({(last - first) / 3600:.2f} h), "
            f"{alerts} alert{'s' if alerts != 1 else ''}"
        )
