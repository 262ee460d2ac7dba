"""``--record FILE``: every point the detection engine judged, in one CSV file.

The format is the ``otel-gpu analyze`` CSV in long form: the usual columns
(``time_s,used_bytes,limit_bytes,util,procs,phase,power_w,power_limit_w,step,temperature_c,
ecc_uncorrected,xid_errors``) plus ``subject`` (``gpu:<uuid>``, ``process:<pid>@<uuid>``,
``rss:<pid>``) and ``label`` (a human name, written on a subject's first row and when it
changes). Rows come in sweep order, so ``otel-gpu analyze FILE`` feeds each subject's points to
the engine exactly as the agent did and raises the same alerts at the same data times, and
``otel-gpu report FILE`` plots it. Floats are written with ``repr`` (exact round trip); an
unknown value is an empty cell. A text cell (subject, label, phase) that a spreadsheet would run
as a formula (``=``, ``+``, ``-``, ``@`` first) is written behind a ``'``; ``analyze`` and
``report`` read the text back exactly.

Two comment lines carry the run's context for ``otel-gpu report``: after the header
``# otel-gpu context {JSON}`` (host, service, git revision and dirty flag, start date, simulated)
and at the end ``# otel-gpu end {JSON}`` (command, redacted; exit code; end date; wall duration).
Each diagnosed alert adds ``# otel-gpu diagnosis {JSON}`` as it happens (``time``, ``kind``,
``subject``, ``message`` of the alert and its ``diagnosis`` as ``--summary-json``'s
``alerts[].diagnosis``: kind, lines, data, time taken or error; redacted; at most
:data:`MAX_DIAGNOSES` a recording): a diagnosis reads live processes and cannot be replayed, so
the report takes it from here, beside the alerts and in "Where the memory went".
``analyze`` and ``report`` skip every line that starts with ``#`` (pandas: ``comment="#"``).

The sampler thread only queues each sweep's rows (bounded: when the disk stalls, whole sweeps
are dropped, counted and logged once); a writer thread writes and flushes them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import queue
import threading
from typing import IO, Any

from otel_gpu.core.errors import UsageError
from otel_gpu.core.private_files import open_private
from otel_gpu.core.redact import redact_value
from otel_gpu.detect.model import NUMERIC_FIELDS, Alert
from otel_gpu.detect.trace import text_cell
from otel_gpu.outputs.summary import diagnosis_record
from otel_gpu.outputs.sweeps import Sweep, labels

log = logging.getLogger("otel_gpu.record")

# The analyze columns (every numeric Point field, procs and phase) after subject and label.
COLUMNS = ("subject", "label", "time_s", *NUMERIC_FIELDS, "procs", "phase")
_QUEUE_SWEEPS = 256
CONTEXT_LINE = "# otel-gpu context "
END_LINE = "# otel-gpu end "
DIAGNOSIS_LINE = "# otel-gpu diagnosis "
MAX_DIAGNOSES = 200  # diagnosed alerts a recording keeps (the engine raises one per problem)


def open_recording(path: str, flag: str = "--record") -> IO[str]:
    """Open (truncate) the recording now, so a bad path is refused before the job starts."""
    try:
        return open_private(path, "w", newline="", encoding="utf-8")  # 0600: the job's names
    except OSError as exc:
        raise UsageError(
            f"{flag} {path}: cannot write ({exc.strerror or exc}); give a writable file path"
        ) from None


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return ""  # the engine treats NaN and infinities as unknown too
    return value


def rows(sweep: Sweep, named: dict[str, str]) -> list[list[Any]]:
    """The CSV rows of one sweep; ``named`` (subject -> label written) is updated."""
    names = labels(sweep.snapshot)
    out = []
    for subject, p in sweep.points:
        label = names.get(subject, "")
        if named.get(subject) == label:
            label = ""
        else:
            named[subject] = label
        cells = [_cell(getattr(p, c)) for c in COLUMNS[3:]]
        if p.phase:  # text from the trainer
            cells[-1] = text_cell(p.phase)
        out.append([text_cell(subject), text_cell(label), p.time, *cells])
    return out


class Recorder:
    """Writes sweeps to an open CSV file from its own thread. A write that fails (a full disk,
    an I/O error) stops the recording with one warning; nothing of it reaches the job or the
    wrapper's exit code, and the other outputs are written as usual."""

    def __init__(self, fh: IO[str], name: str = "--record") -> None:
        self._fh = fh
        self.name = name  # how the warnings name it: "--record FILE"
        self._writer = csv.writer(fh)
        self._queue: queue.Queue[list[list[Any]] | str | None] = queue.Queue(_QUEUE_SWEEPS)
        self._named: dict[str, str] = {}
        self.dropped_sweeps = 0
        self._diagnoses = 0
        self.failed: str | None = None  # why the recording stopped
        self._queue.put_nowait([list(COLUMNS)])  # written (and failing) on the writer thread
        self._thread = threading.Thread(target=self._run, name="otel-gpu-record", daemon=True)
        self._thread.start()

    def on_sweep(self, sweep: Sweep) -> None:
        """On the sampler thread: queue the rows, never wait."""
        if self.failed is not None:
            return  # said once; nothing more is written
        try:
            self._queue.put_nowait(rows(sweep, self._named))
        except queue.Full:
            self.dropped_sweeps += 1
            if self.dropped_sweeps == 1:
                log.warning("recording falls behind (disk slow?): sweeps are being dropped")

    def write_context(self, context: dict[str, Any]) -> None:
        """The run's context line (``report`` shows it); never waits."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_comment(CONTEXT_LINE, context))

    def on_alert(self, alert: Alert) -> None:
        """A diagnosed alert as a comment line (``report`` shows it); never waits."""
        found = diagnosis_record(alert)
        if found is None or self._diagnoses >= MAX_DIAGNOSES:
            return
        self._diagnoses += 1
        entry = {
            "time": alert.time,
            "kind": alert.kind,
            "subject": alert.subject,
            "message": alert.message,
            "diagnosis": found,
        }
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_comment(DIAGNOSIS_LINE, redact_value(entry)))

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                break
            try:
                if isinstance(batch, str):
                    self._fh.write(batch)
                else:
                    self._writer.writerows(batch)
                self._fh.flush()
            except OSError as exc:
                self._fail(exc)
                break

    def _fail(self, exc: OSError) -> None:
        if self.failed is None:
            self.failed = exc.strerror or str(exc)
            log.warning(
                "%s: recording stopped (%s); the file is incomplete, the job runs on",
                self.name, self.failed,
            )  # fmt: skip

    def close(self, timeout_s: float = 2.0, ending: dict[str, Any] | None = None) -> None:
        """Write what is queued and the ``ending`` line (bounded by ``timeout_s``), and close
        the file; never raises."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                if ending is not None:
                    self._queue.put(_comment(END_LINE, ending), timeout=timeout_s)
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            try:
                self._fh.close()  # flushes the rest: may find the disk full too
            except OSError as exc:
                self._fail(exc)
        if self.dropped_sweeps and self.failed is None:
            log.warning("recording: %d sweeps dropped", self.dropped_sweeps)


def _comment(prefix: str, data: dict[str, Any]) -> str:
    # One line whatever the values hold: JSON escapes newlines inside strings.
    return prefix + json.dumps(data, sort_keys=True, default=str) + "\n"


def read_comments(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A recording's context and end lines, merged (empty for a plain trace), and its diagnosed
    alerts (at most :data:`MAX_DIAGNOSES`). Reads the file's comment lines only; a line that
    is not valid JSON, or a diagnosis line without its ``diagnosis``, is passed over."""
    context: dict[str, Any] = {}
    diagnoses: list[dict[str, Any]] = []
    with open(path, encoding="utf-8-sig", errors="replace") as fh:
        for line in fh:
            if not line.startswith((CONTEXT_LINE, END_LINE, DIAGNOSIS_LINE)):
                continue
            try:
                data = json.loads(line.split(" ", 3)[3])
            except (ValueError, IndexError):
                continue
            if not isinstance(data, dict):
                continue
            if not line.startswith(DIAGNOSIS_LINE):
                context.update(data)
            elif isinstance(data.get("diagnosis"), dict) and len(diagnoses) < MAX_DIAGNOSES:
                diagnoses.append(data)
    return context, diagnoses
