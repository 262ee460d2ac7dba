"""Subjects an agent already watches: one problem, one notification.

An agent running detection exports ``otel_gpu.breaker.state`` for every subject it judges, with
the subject's identity attributes (:mod:`otel_gpu.detect.subject`) under its own resource. The
processor reads those points and leaves such subjects to the agent: it does not judge them, so
it raises no alert, transition or notification of its own for them, while the agent's alerts,
transitions and detector metrics are forwarded like any other data. Subjects of reporters that
do not run detection (an exporter without the agent's engine, an agent with
``OTEL_GPU_DETECT=false``) are judged by the processor as before.

Only requests that contain the metric's name are parsed (a byte search first), and only that
metric's points; a subject is released when its reporter has not vouched for it for ``ttl_s``.

A breaker point is the word of whoever sent it, so it is bound to the reporter that owns the
subject: the point must carry the subject's resource identity (its name is built from it) and
come from the peer address that owns that identity (the peer whose data created its first
subject, :attr:`otel_gpu.processor.assemble.Assembler.owners`). Points for an identity another
peer owns are ignored and counted (:attr:`WatchedSubjects.refused`), and the pipeline leaves a
subject to its agent only while the peer that vouched is its owner; so a client that can send
OTLP cannot silence detection for someone else's GPUs by claiming their identity.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from otel_gpu.core.signals import BREAKER_STATE, HW_ID, PROCESS_PID
from otel_gpu.detect.subject import SUBJECT_KIND
from otel_gpu.processor.assemble import subject_name
from otel_gpu.processor.decode import ResourceInfo, resource_info
from otel_gpu.processor.wire import MetricsRequestView, NumberDataPointView, NumberDataRawView

AGENT_METRIC = BREAKER_STATE.name
_NEEDLE = AGENT_METRIC.encode()
_MAX_CACHE = 50_000


class WatchedSubjects:
    """Names of the subjects agents vouch for (the processor's subject names). Not thread-safe."""

    def __init__(self, max_subjects: int, ttl_s: float) -> None:
        self._max = max_subjects
        self._ttl = ttl_s
        # subject name -> the peer that vouched for it last; callers look it up directly (a
        # dict lookup per point, no method call)
        self.seen: dict[str, str] = {}
        self._times: dict[str, float] = {}  # subject name -> monotonic time of the latest point
        self.refused = 0  # breaker points of a reporter identity another peer owns
        self._resources: dict[bytes, ResourceInfo] = {}
        self._names: dict[tuple[str, bytes], str | None] = {}  # (reporter, attributes) -> name

    def __contains__(self, name: object) -> bool:
        return name in self.seen

    def __len__(self) -> int:
        return len(self.seen)

    def note(
        self, raw: bytes, now: float, peer: str = "", owners: Mapping[str, str] | None = None
    ) -> list[str]:
        """Read the agents' breaker points of one metrics request from ``peer``; returns
        newly watched names. ``owners``: reporter label -> the peer that owns it; points for
        an identity another peer owns are skipped (counted in :attr:`refused`).

        Malformed parts are skipped: the decoder judges the request itself.
        """
        if _NEEDLE not in raw:
            return []
        try:
            req = MetricsRequestView.FromString(raw)
        except DecodeError:
            return []
        new: list[str] = []
        for rm in req.resource_metrics:
            res: ResourceInfo | None = None
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name != AGENT_METRIC or not metric.gauge:
                        continue
                    if res is None:
                        res = self._resource(rm.resource)
                    owner = None if owners is None else owners.get(res.label)
                    names = self._points(res, metric.gauge)
                    if owner is not None and owner != peer:
                        self.refused += len(names)  # someone else's identity: not its word
                        continue
                    for name in names:
                        if name not in self.seen:
                            if len(self.seen) >= self._max:
                                continue
                            new.append(name)
                        self.seen[name] = peer
                        self._times[name] = now
        return new

    def expire(self, now: float) -> None:
        """Release subjects whose agent has not vouched for them for ``ttl_s``."""
        cutoff = now - self._ttl
        for name in [n for n, t in self._times.items() if t < cutoff]:
            del self.seen[name]
            del self._times[name]

    def _resource(self, raw: bytes) -> ResourceInfo:
        res = self._resources.get(raw)
        if res is None:
            if len(self._resources) >= _MAX_CACHE:
                self._resources.clear()
            res = self._resources[raw] = resource_info(raw)
        return res

    def _points(self, res: ResourceInfo, gauge: bytes) -> list[str]:
        try:
            points = NumberDataRawView.FromString(gauge).data_points
        except DecodeError:
            return []
        names = []
        for b in points:
            try:
                attrs = tuple(NumberDataPointView.FromString(b).attributes)
            except DecodeError:
                continue
            key = (res.label, b"".join(attrs))
            if key not in self._names:
                if len(self._names) >= _MAX_CACHE:
                    self._names.clear()
                self._names[key] = _name(res, attrs)
            name = self._names[key]
            if name is not None:
                names.append(name)
        return names


def _name(res: ResourceInfo, attrs: tuple[bytes, ...]) -> str | None:
    """The processor's name for the subject an agent's breaker point is about, or None."""
    kind = hw_id = None
    pid: int | None = None
    for raw in attrs:
        try:
            kv = KeyValue.FromString(raw)
        except DecodeError:
            continue
        if kv.key == SUBJECT_KIND:
            kind = kv.value.string_value or None
        elif kv.key == HW_ID:
            hw_id = kv.value.string_value or None
        elif kv.key == PROCESS_PID and kv.value.WhichOneof("value") == "int_value":
            pid = kv.value.int_value
    if kind is None:
        return None  # not the agent's identity attributes: nothing to recognise
    return subject_name(res, kind, hw_id, pid)
