"""Breaker state and alert/notification history in a local SQLite file.

Every transition is committed (WAL, synchronous=FULL) *before* its actions fire, so after a
crash or ``kill -9`` the restarted processor restores the breakers exactly as they were when the
last notification went out: an open breaker stays open, and since actions fire only on
transitions, nothing already notified is sent again (at-most-once: a crash between commit and
sending loses that one notification rather than repeating it).
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from dataclasses import asdict
from typing import Any

from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.model import Alert
from otel_gpu.errors import UsageError

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


class StateStore:
    """SQLite-backed history; ``path=None`` keeps it in memory (lost on exit). Thread-safe."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(path or ":memory:", check_same_thread=False)
            if path:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._db.commit()
        except sqlite3.Error as e:
            raise UsageError(
                f"--state {path!r}: cannot open it as a SQLite database ({e}); "
                "give a writable file path"
            ) from None
        self._lock = threading.Lock()
        self._writes = 0

    def load_breaker(self) -> dict[str, Any] | None:
        """The last committed breaker state, or None when there is none."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='breaker'").fetchone()
        if row is None:
            return None
        try:
            value = json.loads(row[0])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def load_subjects(self) -> dict[str, dict[str, Any]]:
        """Output attributes of subjects that had alerts (for detector metrics after restart)."""
        with self._lock:
            rows = self._db.execute("SELECT name, detail FROM subjects").fetchall()
        out = {}
        for name, detail in rows:
            try:
                out[name] = json.loads(detail)
            except ValueError:
                continue
        return out

    def alert_counts(self) -> dict[tuple[str, str], int]:
        """Alerts logged so far per (subject, kind): the otel_gpu.alerts counter survives restarts."""
        with self._lock:
            rows = self._db.execute(
                "SELECT subject, kind, COUNT(*) FROM alerts GROUP BY subject, kind"
            ).fetchall()
        return {(s, k): int(n) for s, k, n in rows}

    def commit(
        self,
        breaker_state: dict[str, Any] | None,
        transitions: list[Transition],
        alerts: list[Alert],
        subjects: dict[str, dict[str, Any]],
    ) -> None:
        """Write one batch of events in one transaction (durable when it returns)."""
        wall = time.time()
        with self._lock:
            try:
                with self._db:
                    if breaker_state is not None:
                        self._db.execute(
                            "INSERT OR REPLACE INTO meta(key, value) VALUES('breaker', ?)",
                            (_json(breaker_state),),
                        )
                    self._db.executemany(
                        "INSERT INTO transitions(wall, subject, from_state, to_state, time, "
                        "episode, reason, alert) VALUES(?,?,?,?,?,?,?,?)",
                        [
                            (
                                wall, t.subject, t.from_state, t.to_state, t.time, t.episode,
                                t.reason, None if t.alert is None else _json(asdict(t.alert)),
                            )
                            for t in transitions
                        ],
                    )  # fmt: skip
                    self._db.executemany(
                        "INSERT INTO alerts(wall, subject, kind, time, severity, message, detail) "
                        "VALUES(?,?,?,?,?,?,?)",
                        [
                            (
                                wall,
                                a.subject,
                                a.kind,
                                a.time,
                                a.severity,
                                a.message,
                                _json(asdict(a)),
                            )
                            for a in alerts
                        ],
                    )
                    self._db.executemany(
                        "INSERT OR REPLACE INTO subjects(name, detail) VALUES(?, ?)",
                        [(n, _json(d)) for n, d in subjects.items()],
                    )
                self._writes += 1
                if self._writes % 1000 == 0:
                    self._prune()
            except sqlite3.Error as e:
                # A full disk must not stop detection; the next commit retries the state.
                log.error("state store %s: write failed: %s", self.path, e)

    def _prune(self) -> None:
        with self._db:
            for table in ("transitions", "alerts"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE id <= (SELECT MAX(id) FROM {table}) - ?",
                    (_KEEP_ROWS,),
                )

    def history(self, table: str = "transitions") -> list[dict[str, Any]]:
        """All rows of ``transitions`` or ``alerts``, oldest first (for tests and inspection)."""
        if table not in ("transitions", "alerts"):
            raise ValueError(table)
        with self._lock:
            cur = self._db.execute(f"SELECT * FROM {table} ORDER BY id")
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._db.close()
