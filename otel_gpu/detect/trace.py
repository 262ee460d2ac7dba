"""CSV traces for ``otel-gpu analyze``: read and validate a file, replay it through the engine.

Format: a header with ``time_s,used_bytes,limit_bytes`` and optionally ``util`` (0..1),
``procs``, ``phase``, ``power_w``, ``power_limit_w``, ``step``, ``temperature_c``,
``ecc_uncorrected``, ``xid_errors``, in any order. Other columns are ignored (and reported to
``on_unknown``). An empty cell is unknown. Time must not go backwards. A UTF-8 byte-order mark
and CRLF line ends (files saved by spreadsheet programs) are accepted.

A recording (``otel-gpu run --record FILE``) is the same format in long form: a ``subject``
column names the series of each row (``gpu:<uuid>``, ``process:<pid>@<uuid>``, ...), and each
subject is judged on its own points, in file order; ``label`` holds a human name. A text cell
that a spreadsheet would run as a formula is written behind a ``'`` (:func:`text_cell`).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from otel_gpu.core.errors import UsageError
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import NUMERIC_FIELDS, Alert, Point, canonical_phase, point

REQUIRED = ("time_s", "used_bytes", "limit_bytes")
# Every column a detector reads (NUMERIC_FIELDS starts with used_bytes, limit_bytes), and a
# recording's subject and label.
COLUMNS = ("time_s", *NUMERIC_FIELDS, "procs", "phase", "subject", "label")


# A spreadsheet runs a cell starting with one of these as a formula ("=cmd|' /C calc'!A0", a
# process or phase name anyone can choose); such a text cell is written behind a "'", which
# spreadsheets show as text and readers here take off again. A cell that starts with "'" gets
# one more, so every text reads back exactly.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "'")


def text_cell(text: str) -> str:
    """A text value (subject, label, phase) as a recording writes it: never a formula."""
    return "'" + text if text.lstrip(" ").startswith(_FORMULA_START) else text


def read_text_cell(cell: str) -> str:
    """What :func:`text_cell` wrote, back (blanks around it trimmed)."""
    text = cell.strip()
    return text[1:] if text.startswith("'") else text


class TraceError(UsageError):
    """A trace file that cannot be read; the message names the file and line."""


class Row(NamedTuple):
    """One row of a trace: its subject and label (None without those columns) and its point."""

    subject: str | None
    label: str | None
    point: Point


def read_trace(
    path: str | os.PathLike[str],
    *,
    stream: TextIO | None = None,
    on_unknown: Callable[[list[str]], None] | None = None,
) -> list[Point]:
    """All points of a CSV trace, validated. Raises TraceError on the first problem."""
    return [row.point for row in read_rows(path, stream=stream, on_unknown=on_unknown)]


def read_rows(
    path: str | os.PathLike[str],
    *,
    stream: TextIO | None = None,
    on_unknown: Callable[[list[str]], None] | None = None,
) -> list[Row]:
    """All rows of a CSV trace or recording, validated (see :func:`iter_rows`), in memory:
    for what needs them all at once (a report's plots)."""
    return list(iter_rows(path, stream=stream, on_unknown=on_unknown))


def iter_rows(
    path: str | os.PathLike[str],
    *,
    stream: TextIO | None = None,
    on_unknown: Callable[[list[str]], None] | None = None,
) -> Iterator[Row]:
    """The rows of a CSV trace or recording, validated, one at a time as the file is read:
    memory stays flat whatever the file's size. Raises TraceError at the first problem (the
    rows before it have been yielded).

    ``stream``: read this instead of opening ``path`` (which then only names it, e.g. stdin).
    ``on_unknown`` gets the header's columns that no detector reads.
    """
    name = os.fspath(path)
    try:
        if stream is not None:
            yield from _parse(name, stream, on_unknown)
            return
        # utf-8-sig: a byte-order mark would otherwise glue itself to the first column name.
        with open(name, newline="", encoding="utf-8-sig") as fh:
            yield from _parse(name, fh, on_unknown)
    except FileNotFoundError:
        raise TraceError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{name}: is a directory, expected a CSV file") from None
    except PermissionError:
        raise TraceError(f"{name}: permission denied") from None
    except UnicodeDecodeError:
        raise TraceError(f"{name}: not a UTF-8 text CSV file") from None
    except csv.Error as exc:
        raise TraceError(f"{name}: malformed CSV ({exc})") from None


def _parse(
    name: str, lines: Iterable[str], on_unknown: Callable[[list[str]], None] | None
) -> Iterator[Row]:
    # A line starting with "#" is a comment (a recording's context lines): read as an empty
    # line, so line numbers in errors stay the file's.
    reader = csv.reader("\n" if line.startswith("#") else line for line in lines)
    header = next(reader, None)
    while header == []:  # comment or blank lines before the header
        header = next(reader, None)
    if not header:
        raise TraceError(f"{name}:1: empty file, expected a header starting with time_s,used_bytes")
    cols = [h.strip() for h in header]
    if cols:
        cols[0] = cols[0].removeprefix("\ufeff")  # a BOM on a stream not opened as utf-8-sig
    unknown = [c for c in cols if c not in COLUMNS]
    if unknown and on_unknown is not None:
        on_unknown(unknown)
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise TraceError(
            f"{name}:1: header lacks {', '.join(missing)}; expected "
            f"'time_s,used_bytes,limit_bytes[,util,procs,phase,power_w,power_limit_w]'"
        )
    index = {c: i for i, c in enumerate(cols)}
    float_cols = [(index[c], c) for c in NUMERIC_FIELDS if c in index]
    i_time = index["time_s"]
    i_procs = index.get("procs")
    i_phase = index.get("phase")
    i_subject = index.get("subject")
    i_label = index.get("label")
    last = -math.inf
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(cols):
            raise TraceError(f"{name}:{line}: {len(row)} values, header has {len(cols)}")
        t = _number(name, line, "time_s", row[i_time])
        if t is None:
            raise TraceError(f"{name}:{line}: time_s is empty")
        if t < last:
            raise TraceError(f"{name}:{line}: time goes backwards ({t:g} after {last:g})")
        last = t
        values: dict[str, Any] = {}
        for i, field in float_cols:
            values[field] = _number(name, line, cols[i], row[i])
        if i_procs is not None:
            procs = _number(name, line, "procs", row[i_procs])
            if procs is not None and not procs.is_integer():
                raise TraceError(f"{name}:{line}: procs {row[i_procs]!r} is not an integer")
            values["procs"] = None if procs is None else int(procs)
        if i_phase is not None:
            values["phase"] = canonical_phase(read_text_cell(row[i_phase]) or None)
        subject = read_text_cell(row[i_subject]) or None if i_subject is not None else None
        label = read_text_cell(row[i_label]) or None if i_label is not None else None
        yield Row(subject, label, point(t, values))


def _number(name: str, line: int, col: str, text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{name}:{line}: {col} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise TraceError(f"{name}:{line}: {col} {text!r} is not a finite number")
    return value


def subject_for(path: str | os.PathLike[str]) -> str:
    """The subject a replayed file is judged as: ``job:<file name without extension>``."""
    return f"job:{Path(path).stem}"


def replay_rows(engine: Engine, default_subject: str, rows: Iterable[Row]) -> list[Alert]:
    """Feed each row to its subject (``default_subject`` where it names none), in order; all
    alerts raised, then every subject is forgotten."""
    return [alert for _row, alert in replay_iter(engine, default_subject, rows)]


def replay_iter(
    engine: Engine, default_subject: str, rows: Iterable[Row]
) -> Iterator[tuple[Row, Alert]]:
    """:func:`replay_rows` as the rows come: each alert with the row that raised it, as soon
    as it is raised; every subject is forgotten at the end (or when the rows fail)."""
    seen: set[str] = set()
    try:
        for row in rows:
            subject = row.subject or default_subject
            seen.add(subject)
            for alert in engine.observe(subject, row.point):
                yield row, alert
    finally:
        for subject in seen:
            engine.forget(subject)


def replay(engine: Engine, subject: str, points: Iterable[Point]) -> list[Alert]:
    """Feed points in order; all alerts raised, then the subject is forgotten."""
    alerts: list[Alert] = []
    try:
        for p in points:
            alerts.extend(engine.observe(subject, p))
    finally:
        engine.forget(subject)
    return alerts
