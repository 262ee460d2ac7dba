"""The forward queue of one downstream: in memory, or on disk with ``--queue-dir``.

Both keep requests in arrival order, bounded by count and bytes; ``put`` never waits (a full
queue refuses and the caller counts it), ``peek`` hands the sender the oldest requests and
``ack`` removes them once the downstream has answered.

:class:`DiskQueue` is the Collector's persistent queue in SQLite (WAL): each accepted request is
one committed row before the client is answered, so it survives a processor restart or
``kill -9`` and is sent after the restart; a row is deleted in the same transaction that records
its delivery. SQLite rather than hand-written segment files because its commit is atomic (a
kill mid-write leaves the last committed state, never a torn record) and a damaged file is
detected, not misread. Each row also carries the CRC-32 of its payload: a row damaged inside an
intact file (a bit flip, a stray write) is skipped, counted in ``corrupt`` and logged once,
and the rows around it are still delivered. ``synchronous=NORMAL`` in WAL mode survives a process crash; an OS crash
or power loss may lose the last commits (as the Collector's queue without fsync). Delivery is
at-least-once across a crash: a request being sent when the processor dies is sent again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import sqlite3
import threading
import time
import zlib
from collections import deque
from typing import Protocol

from otel_gpu.core.private_files import private_file, tighten_dir

log = logging.getLogger(__name__)


class ForwardQueue(Protocol):
    """What the forwarder needs from a queue (items are ``(id, method, payload)``)."""

    errors: int  # failed disk writes or reads
    corrupt: int  # damaged requests skipped
    failing: bool  # the last disk write or read failed

    def put(self, method: str, payload: bytes) -> bool: ...

    def room(self, size: int) -> bool: ...

    def peek(self, limit: int, max_bytes: int) -> list[tuple[int, str, bytes]]: ...

    def ack(self, ids: list[int]) -> None: ...

    def __len__(self) -> int: ...

    def bytes(self) -> int: ...

    def close(self) -> list[str]: ...


class MemoryQueue:
    """Bounded in-memory queue (lost on exit). Thread-safe."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self._max_requests, self._max_bytes = max_requests, max_bytes
        self._items: deque[tuple[int, str, bytes]] = deque()
        self._size = 0
        self._next = 0
        self._lock = threading.Lock()
        self.errors = 0  # stays 0: the memory queue cannot fail to write
        self.corrupt = 0  # stays 0: nothing in memory is damaged
        self.failing = False

    def room(self, size: int) -> bool:
        """Whether a request of ``size`` bytes would fit now."""
        return len(self._items) < self._max_requests and self._size + size <= self._max_bytes

    def put(self, method: str, payload: bytes) -> bool:
        with self._lock:
            if not self.room(len(payload)):
                return False
            self._next += 1
            self._items.append((self._next, method, payload))
            self._size += len(payload)
            return True

    def peek(self, limit: int, max_bytes: int) -> list[tuple[int, str, bytes]]:
        """The oldest requests of one method, at most ``limit`` and ``max_bytes`` (at least one)."""
        with self._lock:
            return _batch(list(itertools.islice(self._items, limit)), max_bytes)

    def ack(self, ids: list[int]) -> None:
        done = set(ids)
        with self._lock:
            while self._items and self._items[0][0] in done:
                self._size -= len(self._items.popleft()[2])

    def __len__(self) -> int:
        return len(self._items)

    def bytes(self) -> int:
        return self._size

    def close(self) -> list[str]:
        """Forget what is left; returns the export method of each request forgotten."""
        with self._lock:
            lost = [m for _, m, _ in self._items]
            self._items.clear()
            self._size = 0
            return lost


def _batch(items: list[tuple[int, str, bytes]], max_bytes: int) -> list[tuple[int, str, bytes]]:
    out: list[tuple[int, str, bytes]] = []
    size = 0
    for item in items:
        if out and (item[1] != out[0][1] or size + len(item[2]) > max_bytes):
            break
        out.append(item)
        size += len(item[2])
    return out


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS queue (id INTEGER PRIMARY KEY, method TEXT NOT NULL, "
    "payload BLOB NOT NULL, crc INTEGER)"
)


def _queue_entry(name: str) -> bool:
    """Whether ``name`` in a queue directory is one of our files (a queue, its -wal / -shm,
    a damaged one moved aside)."""
    return ".queue.sqlite" in name


def queue_file(directory: str, target: str) -> str:
    """The queue file of one downstream inside ``--queue-dir``."""
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9.-]", "_", target) + ".queue.sqlite")


class DiskQueue:
    """Bounded SQLite-backed queue that survives restarts (see the module doc). Thread-safe."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self.errors = 0  # writes or reads the disk refused (a full disk, I/O errors)
        self.failing = False  # the last disk operation failed (until one succeeds)
        self.corrupt = 0  # requests skipped because their payload no longer matches its CRC
        self._corrupt_warned = False
        try:
            self._db = self._open(path)
        except sqlite3.OperationalError:
            raise  # cannot open, or locked by another processor: the caller says which
        except sqlite3.DatabaseError as e:
            # A damaged queue file must not crash-loop the processor: keep it for inspection
            # and start an empty one.
            aside = f"{path}.corrupt-{int(time.time())}"
            log.warning("forward queue %s is damaged (%s); moved it to %s", path, e, aside)
            os.replace(path, aside)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path + suffix)
            self._db = self._open(path)
        row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM queue")
        self._count, self._size = (int(x) for x in row.fetchone())
        if self._count:
            log.warning("forward queue %s: %d requests from before a restart", path, self._count)

    @staticmethod
    def _open(path: str) -> sqlite3.Connection:
        # Every request verbatim: the file (SQLite gives -wal and -shm its mode) is 0600, and
        # a queue directory that holds only queues is 0700, whoever made it with what umask.
        private_file(path)
        for suffix in ("-wal", "-shm"):
            private_file(path + suffix, create=False)
        tighten_dir(os.path.dirname(os.path.abspath(path)), _queue_entry)
        db = sqlite3.connect(path, check_same_thread=False, timeout=0.5, isolation_level=None)
        try:
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("integrity check failed")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            # One processor per queue file: two would send the same requests twice. The lock
            # is taken by the first write and held until the connection closes.
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
            db.execute(_SCHEMA)
            columns = [r[1] for r in db.execute("PRAGMA table_info(queue)")]
            if "crc" not in columns:  # a queue file from before the checksum: rows NULL, trusted
                db.execute("ALTER TABLE queue ADD COLUMN crc INTEGER")
            db.execute("BEGIN IMMEDIATE")
            db.execute("COMMIT")
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _failed(self, what: str, e: sqlite3.Error) -> None:
        self.errors += 1
        if not self.failing:  # once per episode; cleared by the next success
            self.failing = True
            log.error("forward queue %s: %s failed: %s", self.path, what, e)

    def room(self, size: int) -> bool:
        """Whether a request of ``size`` bytes would fit now. A failing disk is not refused
        here: the next ``put`` tries it again, so the queue recovers once the disk has room."""
        return self._size + size <= self._max_bytes

    def put(self, method: str, payload: bytes) -> bool:
        """Commit one request; False when the queue is full or the disk refuses it."""
        with self._lock:
            if self._size + len(payload) > self._max_bytes:
                return False
            try:
                self._db.execute(
                    "INSERT INTO queue(method, payload, crc) VALUES(?, ?, ?)",
                    (method, payload, zlib.crc32(payload)),
                )
            except sqlite3.Error as e:
                self._failed("write", e)
                return False
            self.failing = False
            self._count += 1
            self._size += len(payload)
            return True

    def peek(self, limit: int, max_bytes: int) -> list[tuple[int, str, bytes]]:
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT id, method, payload, crc FROM queue ORDER BY id LIMIT ?", (limit,)
                ).fetchall()
            except sqlite3.Error as e:
                self._failed("read", e)
                return []
        items: list[tuple[int, str, bytes]] = []
        damaged: list[int] = []
        for i, m, p, crc in rows:
            if not isinstance(p, bytes) or (crc is not None and zlib.crc32(p) != crc):
                damaged.append(int(i))
            else:
                items.append((int(i), str(m), p))
        if damaged:
            self._skip(damaged)
        return _batch(items, max_bytes)

    def _skip(self, ids: list[int]) -> None:
        """Drop damaged rows: sending them would cost the downstream call the others share."""
        self.corrupt += len(ids)
        if not self._corrupt_warned:  # once per queue: further ones are counted
            self._corrupt_warned = True
            log.warning(
                "forward queue %s: %d damaged request(s) skipped (checksum mismatch); further "
                "ones are counted in /stats forward.queue_corrupt",
                self.path,
                len(ids),
            )
        self.ack(ids)

    def ack(self, ids: list[int]) -> None:
        with self._lock:
            try:
                cur = self._db.execute(
                    f"DELETE FROM queue WHERE id IN ({','.join('?' * len(ids))}) "
                    "RETURNING LENGTH(payload)",
                    ids,
                )
                sizes = [int(r[0]) for r in cur.fetchall()]
            except sqlite3.Error as e:
                self._failed("delete", e)
                return
            self._count -= len(sizes)
            self._size -= sum(sizes)

    def __len__(self) -> int:
        return self._count

    def bytes(self) -> int:
        return self._size

    def close(self) -> list[str]:
        """Close the file; what is left stays on disk for the next start (nothing lost)."""
        with self._lock:
            self._db.close()
        return []
