"""Breaker state and alert/notification history in a local SQLite file.

Writes never run on the ingestion path: :meth:`StateStore.commit` queues a batch (bounded) and
one writer thread commits it (WAL, synchronous=FULL), then hands the batch to ``on_durable``,
where the processor fires its actions. So after a crash or ``kill -9`` the restarted processor
restores the breakers as they were when the last notification went out: an open breaker stays
open, and since actions fire only on transitions, nothing already notified is sent again
(at-most-once: a crash between commit and sending loses that one notification).

The store never stalls or crash-loops the processor: a file that is not a readable SQLite
database is moved aside (one warning) and a fresh store begins; a file locked by another process
or a full disk makes writes fail fast (0.2 s lock timeout), each failure is counted and the
processor's ``/healthz`` says why, the newest breaker state and the unwritten history are
retried (once a second) until they are written, and actions still fire: within the running
process the breakers themselves keep the no-repeat guarantee. While the disk itself refuses the
writes (:attr:`StateStore.disk_full`), the processor refuses new exports with a retry delay.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from otel_gpu.core.errors import UsageError
from otel_gpu.core.private_files import private_file
from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.model import Alert

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY, wall REAL NOT NULL, subject TEXT NOT NULL, from_state TEXT NOT NULL,
    to_state TEXT NOT NULL, time REAL NOT NULL, episode INTEGER NOT NULL, reason TEXT NOT NULL,
    alert TEXT);
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY, wall REAL NOT NULL, subject TEXT NOT NULL, kind TEXT NOT NULL,
    time REAL NOT NULL, severity TEXT NOT NULL, message TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS subjects (name TEXT PRIMARY KEY, detail TEXT NOT NULL);
"""
_KEEP_ROWS = 100_000  # history rows kept per table; older ones are pruned
_MAX_PENDING = 10_000  # batches waiting for the writer; beyond that the oldest history goes
_LOCK_TIMEOUT_S = 0.2  # how long one write waits for a lock held by another process


def _json(obj: Any) -> str:
    # JSON has no NaN/inf; they never reach here from the engine, but never fail on them.
    def fix(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        return x

    return json.dumps(fix(obj), separators=(",", ":"), sort_keys=True)


@dataclass
class Batch:
    """One request's events, written in one transaction."""

    transitions: list[Transition]
    alerts: list[Alert]
    subjects: dict[str, dict[str, Any]]
    wall: float = field(default_factory=time.time)


class StateStore:
    """SQLite-backed history; ``path=None`` keeps it in memory (lost on exit). Thread-safe.

    ``on_durable(batch)`` is called on the writer thread after each batch was written (or
    failed to be: the failure is counted, see :attr:`errors`)."""

    def __init__(
        self,
        path: str | None,
        on_durable: Callable[[Batch], None] | None = None,
        *,
        source: str = "--state",
    ) -> None:
        """``source``: the flag or variable ``path`` came from, named in errors."""
        self.path = path
        self.on_durable = on_durable
        self._lock = threading.Lock()  # the connection
        self._cond = threading.Condition()  # the pending batches
        self._pending: deque[Batch] = deque()
        self._state: dict[str, Any] | None = None  # newest breaker state not yet written
        self._busy = False
        self._closing = False
        self._writes = 0
        self.errors = 0  # failed writes
        self.lost = 0  # history batches dropped because the writer fell behind
        self.last_error = ""  # empty after a successful write
        # The last write failed because the disk refused it (full, file-size limit, I/O
        # error), not because another process holds the lock: new exports are then refused.
        self.disk_full = False
        # Batches a failed write could not store, retried with the next write (once a second
        # while failing), so that a disk that fills up for a while loses no history.
        self._unwritten: list[Batch] = []
        self.moved_aside = ""  # where a damaged file went
        try:
            self._db = self._open(path)
        except sqlite3.OperationalError as e:
            # Cannot even open it (a directory, no permission): the user's setting is wrong.
            raise UsageError(
                f"{source}={path!r}: cannot open it as a SQLite database ({e}); "
                "give a writable file path"
            ) from None
        except sqlite3.DatabaseError as e:
            assert path is not None  # memory databases are never damaged
            self.moved_aside = f"{path}.corrupt-{int(time.time())}"
            log.warning(
                "state %s is damaged (%s): moved it to %s and started a fresh store",
                path,
                e,
                self.moved_aside,
            )
            os.replace(path, self.moved_aside)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path + suffix, self.moved_aside + suffix)
            self._db = self._open(path)
        self._thread = threading.Thread(target=self._run, name="otel-gpu-state", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(path: str | None) -> sqlite3.Connection:
        if path and path != ":memory:":  # alert history: 0600 (SQLite gives -wal, -shm its mode)
            with contextlib.suppress(OSError):  # not a file: SQLite says so below
                private_file(path)
                for suffix in ("-wal", "-shm"):
                    private_file(path + suffix, create=False)
        db = sqlite3.connect(path or ":memory:", check_same_thread=False, timeout=_LOCK_TIMEOUT_S)
        try:
            if path:
                try:
                    row = db.execute("PRAGMA quick_check").fetchone()
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e):
                        raise
                    row = ("ok",)  # held by another process: reads and writes fail, counted
                if row is None or row[0] != "ok":
                    raise sqlite3.DatabaseError(f"integrity check: {row and row[0]}")
                # Locked by another process: set on a later start; writes fail and are counted.
                with contextlib.suppress(sqlite3.OperationalError):
                    db.execute("PRAGMA journal_mode=WAL")
                with contextlib.suppress(sqlite3.OperationalError):
                    db.execute("PRAGMA synchronous=FULL")
            with contextlib.suppress(sqlite3.OperationalError):  # locked: tables exist
                db.executescript(_SCHEMA)
                db.commit()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _read(self, sql: str) -> list[Any]:
        with self._lock:
            try:
                return self._db.execute(sql).fetchall()
            except sqlite3.Error as e:
                self._failed(f"read failed: {e}")
                return []

    def load_breaker(self) -> dict[str, Any] | None:
        """The last committed breaker state, or None when there is none."""
        rows = self._read("SELECT value FROM meta WHERE key='breaker'")
        if not rows:
            return None
        try:
            value = json.loads(rows[0][0])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def load_subjects(self) -> dict[str, dict[str, Any]]:
        """Output attributes of subjects that had alerts (for detector metrics after restart)."""
        out = {}
        for name, detail in self._read("SELECT name, detail FROM subjects"):
            try:
                out[name] = json.loads(detail)
            except ValueError:
                continue
        return out

    def alert_counts(self) -> dict[tuple[str, str], int]:
        """Alerts logged so far per (subject, kind): the otel_gpu.alerts counter survives restarts."""
        rows = self._read("SELECT subject, kind, COUNT(*) FROM alerts GROUP BY subject, kind")
        return {(s, k): int(n) for s, k, n in rows}

    def commit(
        self,
        breaker_state: dict[str, Any] | None,
        transitions: list[Transition],
        alerts: list[Alert],
        subjects: dict[str, dict[str, Any]],
    ) -> None:
        """Queue one batch of events for the writer (never waits on the disk)."""
        with self._cond:
            if breaker_state is not None:
                self._state = breaker_state  # only the newest state matters
            if len(self._pending) >= _MAX_PENDING:
                self._pending.popleft()
                self.lost += 1
            self._pending.append(Batch(transitions, alerts, subjects))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._pending
                    and self._state is None
                    and not self._unwritten
                    and not self._closing
                ):
                    self._cond.wait()
                if not self._pending and self._state is None and not self._unwritten:
                    return
                batches = list(self._pending)
                self._pending.clear()
                state, self._state = self._state, None
                self._busy = True
            ok = self._write(state, self._unwritten + batches)
            if ok:
                self._unwritten = []
            else:
                kept = self._unwritten + batches
                self.lost += max(0, len(kept) - _MAX_PENDING)
                self._unwritten = kept[-_MAX_PENDING:]
            if not ok and state is not None:
                with self._cond:  # retried with the next batch, unless a newer state came
                    if self._state is None:
                        self._state = state
            for b in batches:
                if self.on_durable is not None:
                    try:
                        self.on_durable(b)
                    except Exception:
                        log.exception("acting on stored events failed")
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                if not ok:
                    if self._closing:
                        return  # shutting down: that was the last try (the failure is counted)
                    self._cond.wait(1.0)  # a locked file or full disk: no tight retry loop

    def _write(self, state: dict[str, Any] | None, batches: list[Batch]) -> bool:
        with self._lock:
            try:
                with self._db:
                    if state is not None:
                        self._db.execute(
                            "INSERT OR REPLACE INTO meta(key, value) VALUES('breaker', ?)",
                            (_json(state),),
                        )
                    for b in batches:
                        self._insert(b)
                self._writes += 1
                if self._writes % 1000 == 0:
                    self._prune()
            except sqlite3.Error as e:
                name = getattr(e, "sqlite_errorname", "")
                # SQLITE_FULL is ENOSPC; EFBIG (a file-size limit) and EIO read as SQLITE_IOERR_*.
                self.disk_full = name == "SQLITE_FULL" or name.startswith("SQLITE_IOERR")
                self._failed(f"write failed: {e}")
                return False
        self.disk_full = False
        if self.last_error:
            log.warning("state store %s: writing again", self.path)
        self.last_error = ""
        return True

    def _failed(self, why: str) -> None:
        self.errors += 1
        if not self.last_error:  # once per episode
            log.error("state store %s: %s (counted; retrying)", self.path, why)
        self.last_error = why

    def _insert(self, b: Batch) -> None:
        self._db.executemany(
            "INSERT INTO transitions(wall, subject, from_state, to_state, time, "
            "episode, reason, alert) VALUES(?,?,?,?,?,?,?,?)",
            [
                (
                    b.wall, t.subject, t.from_state, t.to_state, t.time, t.episode,
                    t.reason, None if t.alert is None else _json(asdict(t.alert)),
                )
                for t in b.transitions
            ],
        )  # fmt: skip
        self._db.executemany(
            "INSERT INTO alerts(wall, subject, kind, time, severity, message, detail) "
            "VALUES(?,?,?,?,?,?,?)",
            [
                (b.wall, a.subject, a.kind, a.time, a.severity, a.message, _json(asdict(a)))
                for a in b.alerts
            ],
        )
        self._db.executemany(
            "INSERT OR REPLACE INTO subjects(name, detail) VALUES(?, ?)",
            [(n, _json(d)) for n, d in b.subjects.items()],
        )

    def _prune(self) -> None:
        with self._db:
            for table in ("transitions", "alerts"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE id <= (SELECT MAX(id) FROM {table}) - ?",
                    (_KEEP_ROWS,),
                )

    def snapshot(self) -> dict[str, int | bool]:
        """The counters, for /stats and self-telemetry."""
        return {"errors": self.errors, "lost": self.lost, "failing": bool(self.last_error)}

    def problem(self) -> str | None:
        """Why health is degraded by the store, if it is."""
        if not self.last_error:
            return None
        then = (
            "exports are refused until it writes again"
            if self.disk_full
            else "detection and forwarding go on"
        )
        return (
            f"the state store {self.path} fails ({self.last_error}; {self.errors} failures); {then}"
        )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued was written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            # A state that failed to be written is retried later: not waited for here.
            while self._pending or self._busy or (self._state is not None and not self.last_error):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def history(self, table: str = "transitions") -> list[dict[str, Any]]:
        """All rows of ``transitions`` or ``alerts``, oldest first (for tests and inspection)."""
        if table not in ("transitions", "alerts"):
            raise ValueError(table)
        self.flush()
        with self._lock:
            cur = self._db.execute(f"SELECT * FROM {table} ORDER BY id")
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (bounded by ``timeout_s``), then close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._lock:
            self._db.close()
