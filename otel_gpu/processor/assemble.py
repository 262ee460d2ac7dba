"""Assemble decoded points into one detection :class:`Point` per subject per timestamp.

An agent's collection shares one timestamp, but a collector may split it over several requests,
so a subject's point stays *pending* until a newer timestamp arrives for it or until it has been
pending ``grace_s`` (monotonic time) (:meth:`Assembler.flush_due`). Points older than a subject's
pending or last emitted time are late: counted and dropped (detection is causal and in time
order). State is bounded: at most ``max_series`` subjects, at most ``per_reporter`` of them
from one reporter (a resource identity, which a client chooses) and at most ``per_peer`` from
one peer address (which it cannot choose: ten made-up identities still share one quota), so
one client cannot fill the cap for all (points of refused subjects are counted as overflow by
the decoder, once each), each holding one pending point; subjects silent for ``ttl_s`` are
evicted (:meth:`Assembler.evict`). Each reporter identity is owned by the peer that sent its
first subject (:attr:`Assembler.owners`, until its subjects are all evicted), and each
subject remembers that peer.

The straggler judge's points (a rank's work per step, a GPU's facts) are no subject's: they go
to :attr:`Assembler.stragglers` as they come (processor/stragglers.py), with the GPU of each
reporter's torch series (the GPU a rank computes on).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_gpu.detect.model import ROW_FIELDS, Point, canonical_phase, point_from_row
from otel_gpu.detect.subject import subject_attributes
from otel_gpu.processor.decode import (
    COUNTED,
    DEVICE,
    F_LIMIT,
    F_PHASE,
    F_PROCS,
    F_STEP,
    PROCESS_GPU,
    TORCH,
    ResourceInfo,
)

_NFIELDS = len(ROW_FIELDS)


@dataclass(frozen=True, slots=True)
class Subject:
    """A detection subject: its name (the engine and breaker key, unique across reporters) and
    the identity attributes of its outputs (the same the agent gives it, see detect/subject.py)."""

    name: str
    kind: str
    resource: ResourceInfo
    attrs: tuple[tuple[str, str | int], ...]  # point attributes of detector outputs
    hw_id: str | None = None
    pid: int | None = None
    peer: str = ""  # the peer address whose data created it (counted against its quota)


class _Series:
    __slots__ = ("subject", "t", "vals", "last_t", "seen", "limit")

    def __init__(self, subject: Subject) -> None:
        self.subject = subject
        self.t = 0  # pending timestamp (ns); 0 when nothing is pending
        self.vals: list[Any] = [None] * _NFIELDS  # a row of Point's fields (ROW_FIELDS)
        self.last_t = 0  # last emitted timestamp (ns)
        self.seen = 0.0  # wall time of the last point (for eviction)
        self.limit: float | None = None  # last known memory limit (devices)


class _Target:
    __slots__ = ("series", "fld", "device")

    def __init__(self, series: _Series, fld: int, device: _Series | None) -> None:
        self.series = series
        self.fld = fld
        self.device = device  # the GPU whose process count this point adds to


class _Job:
    __slots__ = ("phase_t", "phase", "step_t", "step")

    def __init__(self) -> None:
        self.phase_t = self.step_t = 0
        self.phase: float | str | None = None
        self.step: float | str | None = None


def subject_name(res: ResourceInfo, kind: str, hw_id: str | None, pid: int | None) -> str:
    """Human-readable, stable subject name, e.g. ``host.name=n1 gpu GPU-3f..``."""
    if kind == DEVICE:
        return f"{res.label} gpu {hw_id}"
    if kind == PROCESS_GPU:
        return f"{res.label} pid {pid} gpu {hw_id}"
    where = f" gpu {hw_id}" if hw_id is not None else ""
    who = "" if pid is None else f" pid {pid}"
    return f"{res.label}{who} {kind}{where}"


class Assembler:
    """Collects routed points per subject and hands complete Points to ``emit``. Not thread-safe.

    ``emit(subject, point)`` is called in data-time order per subject.
    """

    def __init__(
        self,
        emit: Callable[[Subject, Point], None],
        max_series: int,
        grace_s: float,
        ttl_s: float,
        per_reporter: int | None = None,
        per_peer: int | None = None,
    ) -> None:
        self._emit = emit
        self._max = max_series
        self._per_reporter = per_reporter or max_series
        self._per_peer = per_peer or max_series
        self._by_reporter: dict[str, int] = {}  # subjects held per reporter label
        self._by_peer: dict[str, int] = {}  # subjects held per peer address
        self.owners: dict[str, str] = {}  # reporter label -> the peer that owns it
        self.peer = ""  # peer address of the request being decoded; set by the caller
        self.cap_refused = 0  # new subjects refused because max_series were held
        self.peer_refused = 0  # new subjects refused by the per-peer quota
        self.peers_at_quota: dict[str, None] = {}  # peers refused since they last had room
        self._grace = grace_s
        self._ttl = ttl_s
        self._series: dict[tuple[str, str, str | None, int | None], _Series] = {}
        self._jobs: dict[str, _Job] = {}
        self._opened: deque[tuple[float, _Series, int]] = deque()
        self.now = 0.0  # monotonic clock of the request being decoded; set by the caller
        self.generation = 0  # bumped when subjects are evicted: cached targets are stale
        self.overflow = 0  # points of subjects refused by the cap
        self.late = 0  # points older than their subject's pending/emitted time
        self.emitted = 0  # Points handed to emit
        self.stragglers: Any = None  # processor/stragglers.py's Stragglers, when judged

    def __len__(self) -> int:
        return len(self._series)

    def target(
        self, res: ResourceInfo, kind: str, hw_id: str | None, pid: int | None, fld: int
    ) -> _Target | None:
        """Handle for one series' field (the decoder caches it); None when the cap refuses."""
        s = self._get(res, kind, hw_id, pid)
        if s is None:
            return None
        dev = None
        if (kind, fld) in COUNTED:
            # Count the processes holding each GPU at a timestamp: the stall detector's
            # "someone holds the GPU" signal.
            dev = self._get(res, DEVICE, hw_id, None)
        return _Target(s, fld, dev)

    def put(self, tg: _Target, time_ns: int, value: float) -> None:
        """One routed point (the decoder's Sink); the hot path: a point of the timestamp its
        series has pending (most of them) makes no call."""
        s = tg.series
        if time_ns != s.t and not self._open(s, time_ns):
            self.late += 1
            return
        s.vals[tg.fld] = value
        dev = tg.device
        if dev is not None:
            if time_ns != dev.t and not self._open(dev, time_ns):
                return
            dev.vals[F_PROCS] = (dev.vals[F_PROCS] or 0) + 1

    def _open(self, s: _Series, time_ns: int) -> bool:
        """Make ``time_ns`` the pending timestamp of ``s``, after flushing the one it had;
        False when ``time_ns`` is late (not after the pending or last emitted one)."""
        if time_ns > s.t and time_ns > s.last_t:
            if s.t:
                self._flush(s)
            s.t = time_ns
            s.seen = self.now
            self._opened.append((self.now, s, time_ns))
            return True
        return False

    def put_job(self, res: ResourceInfo, time_ns: int, fld: int, value: float | str) -> None:
        """training.phase / training.step of a reporter; applies to all its subjects."""
        job = self._jobs.get(res.job)
        if job is None:
            if len(self._jobs) >= self._max:
                self.overflow += 1
                return
            job = self._jobs[res.job] = _Job()
        if fld == F_PHASE:
            if time_ns >= job.phase_t:
                job.phase_t = time_ns
                job.phase = canonical_phase(value) if isinstance(value, str) else value
        elif time_ns >= job.step_t:
            job.step_t, job.step = time_ns, value

    def put_work(self, res: ResourceInfo, time_ns: int, value: float) -> None:
        """training.step.work of a rank (the decoder's Sink)."""
        if self.stragglers is not None:
            self.stragglers.work(res, time_ns, value, self.peer, self.now)

    def put_fact(self, hw_id: str, metric: str, selector: str, time_ns: int, value: float) -> None:
        """A GPU fact a straggler alert quotes (the decoder's Sink)."""
        if self.stragglers is not None:
            self.stragglers.fact(hw_id, metric, selector, time_ns, value, self.now)

    def _get(
        self, res: ResourceInfo, kind: str, hw_id: str | None, pid: int | None
    ) -> _Series | None:
        key = (res.label, kind, hw_id, pid)
        s = self._series.get(key)
        if s is None:
            peer = self.peer
            held = self._by_reporter.get(res.label, 0)
            by_peer = self._by_peer.get(peer, 0)
            if len(self._series) >= self._max:
                self.cap_refused += 1
                return None
            if by_peer >= self._per_peer:
                self.peer_refused += 1
                if len(self.peers_at_quota) < 1024:
                    self.peers_at_quota[peer] = None
                return None
            if held >= self._per_reporter:
                return None
            self._by_reporter[res.label] = held + 1
            self._by_peer[peer] = by_peer + 1
            self.owners.setdefault(res.label, peer)
            name = subject_name(res, kind, hw_id, pid)
            attrs = subject_attributes(kind, hw_id, pid)
            s = self._series[key] = _Series(Subject(name, kind, res, attrs, hw_id, pid, peer))
            s.seen = self.now
            if kind == TORCH and hw_id and self.stragglers is not None:
                self.stragglers.device(res.label, hw_id, self.now)
        return s

    def _flush(self, s: _Series) -> None:
        v = s.vals
        t = s.t
        s.last_t, s.t = t, 0
        s.vals = [None] * _NFIELDS
        sub = s.subject
        kind = sub.kind
        if kind == DEVICE:
            limit = v[F_LIMIT]
            if limit is not None:
                s.limit = limit
        elif kind == PROCESS_GPU:
            dev = self._series.get((sub.resource.label, DEVICE, sub.hw_id, None))
            limit = None if dev is None else dev.limit
        else:
            limit = None
        phase = step = None
        if self._jobs:
            job = self._jobs.get(sub.resource.job)
            if job is not None:
                if job.phase_t and job.phase_t <= t:
                    phase = job.phase
                if job.step_t and job.step_t <= t:
                    step = job.step
        procs = v[F_PROCS]
        v[F_PROCS] = None if procs is None else int(procs)
        v[F_LIMIT] = limit
        v[F_PHASE] = phase
        v[F_STEP] = step
        self.emitted += 1
        self._emit(sub, point_from_row(t / 1e9, v))

    def flush_due(self, now: float, all_pending: bool = False) -> None:
        """Emit points pending for ``grace_s`` or longer; all of them if ``all_pending``."""
        cutoff = now - self._grace
        opened = self._opened
        while opened and (all_pending or opened[0][0] <= cutoff):
            _, s, t = opened.popleft()
            if s.t == t:  # still pending (not flushed by a newer point, not evicted)
                self._flush(s)

    def evict(self, now: float) -> list[Subject]:
        """Forget subjects silent for ``ttl_s`` (the clock ``now`` is read from); returns them."""
        cutoff = now - self._ttl
        gone = [k for k, s in self._series.items() if s.seen < cutoff]
        out = []
        if gone:
            self.generation += 1
        for k in gone:
            s = self._series.pop(k)
            label = s.subject.resource.label
            self._by_reporter[label] -= 1
            if not self._by_reporter[label]:
                del self._by_reporter[label]
                self.owners.pop(label, None)  # a later reporter of that identity owns it anew
            peer = s.subject.peer
            self._by_peer[peer] -= 1
            if not self._by_peer[peer]:
                del self._by_peer[peer]
            self.peers_at_quota.pop(peer, None)
            if s.t:
                self._flush(s)
                s.t = 0
            out.append(s.subject)
        live = {s.subject.resource.job for s in self._series.values()}
        for label in [lb for lb in self._jobs if lb not in live]:
            del self._jobs[label]
        return out

    def subjects(self) -> list[Subject]:
        """Subjects currently tracked."""
        return [s.subject for s in self._series.values()]
