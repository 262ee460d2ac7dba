"""The frame stream from the sampling helper to the agent: compact, and static fields sent once.

Each frame is a 4-byte big-endian length and a :mod:`marshal` payload of plain values (tuples,
numbers, strings, None): no class is named on the wire and nothing is called while decoding, and
``marshal`` writes and reads such values several times faster than pickling the snapshot's
records did (their ``__reduce__`` runs Python code per record).

A snapshot is sent against what the same stream already carried (both ends keep the same
tables, built only from what was sent, and reset with each new helper process):

* the fields of a GPU, a process or a GPU process that do not change between sweeps (UUID,
  index and name; PID, command, owner, start time, ...) are sent once with a number, then only
  the number, and again whenever one of them changes (a re-parented process gets a new entry);
* a record whose changing fields are the same as in the last sweep (a sleeping process) is sent
  as its number alone, and the agent reuses the record it built then;
* an entry not used by a snapshot is dropped at both ends after it.

The helper is our own code, but the agent still treats the stream as untrusted input: any
malformed frame is a :class:`ValueError` ("a broken stream"), and the helper is restarted.
"""

from __future__ import annotations

import dataclasses
import marshal
import operator
import struct
from collections.abc import Iterable
from typing import Any

from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

FRAME_HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20  # a frame larger than this is a corrupt stream, not a snapshot
VERSION = "snapshot/1"  # the first value of an encoded snapshot

# What changes from sweep to sweep; every other field is static (sent once per entry).
_GPU_FIELDS = tuple(f.name for f in dataclasses.fields(GpuSample))
_GPU_STATIC = ("uuid", "index", "name", "parent")
_GPU_DYNAMIC = tuple(f for f in _GPU_FIELDS if f not in _GPU_STATIC)
_PROC_DYNAMIC = frozenset(
    {"cpu_utilization", "memory_rss", "memory_virtual", "thread_count", "fd_count"}
)
_PROC_STATIC_AT = tuple(i for i, f in enumerate(ProcessSample._fields) if f not in _PROC_DYNAMIC)
_PROC_DYNAMIC_AT = tuple(i for i, f in enumerate(ProcessSample._fields) if f in _PROC_DYNAMIC)
_GPROC_STATIC_AT = (0, 1)  # pid, gpu_uuid
_GPROC_DYNAMIC_AT = tuple(range(2, len(GpuProcessSample._fields)))


def _picker(at: tuple[int, ...]) -> Any:
    """A C-level getter of the fields at ``at`` as a tuple."""
    return operator.itemgetter(*at) if len(at) > 1 else lambda record: (record[at[0]],)


def _joiner(static_at: tuple[int, ...], dynamic_at: tuple[int, ...], size: int) -> Any:
    """Rebuilds a record's field tuple from its static and dynamic parts."""
    order = sorted(
        [(i, 0, k) for k, i in enumerate(static_at)] + [(i, 1, k) for k, i in enumerate(dynamic_at)]
    )
    assert [i for i, _, _ in order] == list(range(size))
    where = [(part, k) for _, part, k in order]

    def join(static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> tuple[Any, ...]:
        parts = (static, dynamic)
        return tuple([parts[p][k] for p, k in where])

    return join


_gpu_static = operator.attrgetter(*_GPU_STATIC)
_gpu_dynamic = operator.attrgetter(*_GPU_DYNAMIC)
_proc_static = _picker(_PROC_STATIC_AT)
_proc_dynamic = _picker(_PROC_DYNAMIC_AT)
_proc_join = _joiner(_PROC_STATIC_AT, _PROC_DYNAMIC_AT, len(ProcessSample._fields))
_gproc_static = _picker(_GPROC_STATIC_AT)
_gproc_dynamic = _picker(_GPROC_DYNAMIC_AT)
_gproc_join = _joiner(_GPROC_STATIC_AT, _GPROC_DYNAMIC_AT, len(GpuProcessSample._fields))


class _Table:
    """One kind of record at the sending end: static part -> number; last dynamic part."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Any, ...], int] = {}
        self.last: dict[int, tuple[Any, ...]] = {}
        self._next = 0

    def rows(self, items: Iterable[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> tuple[Any, ...]:
        """Encoded rows: ``n`` (unchanged), ``(n, dynamic)`` or ``(n, dynamic, static)`` (new)."""
        out: list[Any] = []
        used: dict[tuple[Any, ...], int] = {}
        last: dict[int, tuple[Any, ...]] = {}
        ids = self.ids
        for static, dynamic in items:
            n = ids.get(static)
            if n is None:
                n = self._next
                self._next += 1
                out.append((n, dynamic, static))
            elif self.last.get(n) == dynamic:
                out.append(n)
            else:
                out.append((n, dynamic))
            used[static] = n
            last[n] = dynamic
        self.ids, self.last = used, last
        return tuple(out)


class SnapshotEncoder:
    """The helper's end: snapshots to plain values (see the module docstring)."""

    def __init__(self) -> None:
        self._gpus = _Table()
        self._procs = _Table()
        self._gprocs = _Table()
        self._h2l: dict[int, int] | None = None

    def encode(self, snap: Snapshot) -> tuple[Any, ...]:
        gpus = self._gpus.rows((_gpu_static(g), _gpu_dynamic(g)) for g in snap.gpus)
        procs = self._procs.rows((_proc_static(p), _proc_dynamic(p)) for p in snap.processes)
        gprocs = self._gprocs.rows(
            (_gproc_static(p), _gproc_dynamic(p)) for p in snap.gpu_processes
        )
        h2l = None if snap.host_to_local == self._h2l else dict(snap.host_to_local)
        self._h2l = dict(snap.host_to_local)
        return (
            VERSION,
            snap.time,
            gpus,
            gprocs,
            procs,
            snap.processes_dropped,
            snap.unmapped_gpu_pids,
            h2l,
            snap.no_gpu_reason,
            snap.sweep_seconds,
            snap.nvml_errors,
            snap.intervals,
        )


class _Rebuilt:
    """One kind of record at the receiving end: number -> (static part, last record)."""

    def __init__(self, build: Any) -> None:
        self._build = build
        self._static: dict[int, tuple[Any, ...]] = {}
        self._record: dict[int, Any] = {}

    def records(self, rows: Any) -> tuple[Any, ...]:
        out = []
        static: dict[int, tuple[Any, ...]] = {}
        record: dict[int, Any] = {}
        for row in rows:
            if isinstance(row, int):
                n = row
                rec = self._record[n]
                static[n] = self._static[n]
            else:
                n, dynamic = row[0], row[1]
                part = row[2] if len(row) > 2 else self._static[n]
                rec = self._build(part, dynamic)
                static[n] = part
            record[n] = rec
            out.append(rec)
        self._static, self._record = static, record
        return tuple(out)


def _gpu(static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> GpuSample:
    return GpuSample(
        **dict(zip(_GPU_STATIC, static, strict=True)),
        **dict(zip(_GPU_DYNAMIC, dynamic, strict=True)),
    )


def _proc(static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> ProcessSample:
    return ProcessSample._make(_proc_join(static, dynamic))


def _gproc(static: tuple[Any, ...], dynamic: tuple[Any, ...]) -> GpuProcessSample:
    return GpuProcessSample._make(_gproc_join(static, dynamic))


class SnapshotDecoder:
    """The agent's end: plain values back to a :class:`Snapshot`; ValueError when malformed."""

    def __init__(self) -> None:
        self._gpus = _Rebuilt(_gpu)
        self._procs = _Rebuilt(_proc)
        self._gprocs = _Rebuilt(_gproc)
        self._h2l: dict[int, int] = {}

    def decode(self, value: Any) -> Snapshot:
        try:
            (version, time_, gpus, gprocs, procs, dropped, unmapped, h2l, reason, took, errors,
             intervals) = value  # fmt: skip
            if version != VERSION:
                raise ValueError(f"unknown snapshot encoding {version!r}")
            if h2l is not None:
                self._h2l = dict(h2l)
            return Snapshot(
                time=float(time_),
                gpus=self._gpus.records(gpus),
                gpu_processes=self._gprocs.records(gprocs),
                processes=self._procs.records(procs),
                processes_dropped=int(dropped),
                unmapped_gpu_pids=tuple(unmapped),
                host_to_local=dict(self._h2l),
                no_gpu_reason=reason,
                sweep_seconds=took,
                nvml_errors=tuple(tuple(e) for e in errors),
                intervals=tuple(tuple(i) for i in intervals),
            )
        except ValueError:
            raise
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"malformed snapshot ({type(exc).__name__}: {exc})") from None


class FrameWriter:
    """Messages to frames, at the helper's end: ``("snapshot", Snapshot)`` is encoded against
    the stream's tables; any other message must be plain values (``("hung", {...})``)."""

    def __init__(self) -> None:
        self._snapshots = SnapshotEncoder()

    def frame(self, message: tuple[Any, ...]) -> bytes:
        if message and message[0] == "snapshot":
            message = ("snapshot", self._snapshots.encode(message[1]))
        payload = marshal.dumps(message, 4)
        return FRAME_HEADER.pack(len(payload)) + payload


class FrameReader:
    """Splits a byte stream into the messages :class:`FrameWriter` wrote (snapshots decoded)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._snapshots = SnapshotDecoder()

    def feed(self, data: bytes) -> list[object]:
        self._buf += data
        out: list[object] = []
        while len(self._buf) >= FRAME_HEADER.size:
            (size,) = FRAME_HEADER.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise ValueError(f"corrupt sampler stream (frame of {size} bytes)")
            end = FRAME_HEADER.size + size
            if len(self._buf) < end:
                break
            payload = bytes(self._buf[FRAME_HEADER.size : end])
            del self._buf[:end]
            try:
                message = marshal.loads(payload)
            except (EOFError, TypeError, ValueError) as exc:
                raise ValueError(f"corrupt sampler frame ({exc})") from None
            if isinstance(message, tuple) and len(message) == 2 and message[0] == "snapshot":
                message = ("snapshot", self._snapshots.decode(message[1]))
            out.append(message)
        return out
