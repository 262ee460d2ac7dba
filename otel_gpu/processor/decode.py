"""Decode only the series the detectors use, straight from the request bytes.

A request is read through the shallow views in :mod:`otel_gpu.processor.wire`; only metrics
named in :data:`ROUTES` have their points read. Resources and attribute sets repeat from one
export to the next, so both are parsed once and cached by their encoded bytes (bounded caches).
A data point in the layout SDKs write (start time, time and value as fixed-width fields, then
only its attributes, canonically encoded) is read in place, its attribute bytes being the cache
key; any other layout is parsed in full, so every valid encoding decodes the same way.

Each accepted point goes to a :class:`Sink` as ``(resource, kind, hw_id, pid, time_ns, field,
value)``. A point of a routed metric is *rejected* when its value is NaN, infinite or missing,
its timestamp is zero, before ``min_time_unix_s`` or more than ``max_future_s`` ahead of the
processor's clock, or its start time is after its time; the caller reports those in
``partial_success`` and strips them from the forwarded copy (:func:`strip_rejected`).

Points that are valid on the wire but that the detectors cannot read are *ignored*: forwarded
as they are, counted, never judged. Those are the points of a Sum whose temporality is not one
OTLP defines (a newer sender's: the downstream may know it), and a monotonic cumulative Sum's
point below the previous one of the same series and start time (a broken counter: judging it
would read as errors going away).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from otel_gpu.core.signals import (
    CLOCK_DOMAIN,
    COUNT,
    FEEDS,
    GPU_CLOCK,
    GPU_INDEX,
    GPU_PCIE,
    GPU_THROTTLE,
    HW_ID,
    IO_DIRECTION,
    JOB,
    PHASE,
    PROCESS_PID,
    THROTTLE_REASON,
    TRAINING_STEP_WORK,
    VALUE,
)
from otel_gpu.detect.model import ROW_FIELDS
from otel_gpu.detect.subject import GPU, GPU_INDEX_PREFIX, PROCESS_GPU, TORCH
from otel_gpu.processor.wire import MetricsRequestView, NumberDataPointView, NumberDataRawView

# Subject kinds (detect/subject.py; JOB: training.phase / training.step of a resource).
DEVICE = GPU

# A pending point's values are a row of Point's fields (ROW_FIELDS, assemble.py); a routed point
# feeds the field at its index. A job's fields (phase, step) are held per resource.
F_USED, F_LIMIT, F_PROCS, F_STEP, F_PHASE = map(
    ROW_FIELDS.index, ("used_bytes", "limit_bytes", "procs", "step", "phase")
)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a routed metric's points go: a subject kind, and the Point field each point feeds
    by the value of its attribute ``key`` (``None``: the attribute is absent or not asked)."""

    kind: str
    key: str | None
    fields: dict[str | None, int]  # -> index in ROW_FIELDS


def _routes() -> dict[str, Route]:
    routes: dict[str, Route] = {}
    for feed in FEEDS:
        if feed.how != VALUE:
            continue  # derived by the assembler (process counts, a process's GPU limit)
        key, values = feed.select or (None, (None,))
        route = routes.setdefault(feed.signal.name, Route(feed.subject, key, {}))
        if (route.kind, route.key) != (feed.subject, key):
            raise ValueError(
                f"{feed.signal.name}: one metric routes to one subject kind by one key"
            )
        route.fields.update(dict.fromkeys(values, ROW_FIELDS.index(feed.field)))
    return routes


# Beside the engine's routes, the straggler judge's (processor/stragglers.py), which feed no
# Point field: each rank's work per step (the rank is on its resource), and the facts of a GPU
# that a straggler alert quotes (its SM clock, throttle reasons and PCIe throughput; its
# temperature and power come with the engine's GPU points).
RANK = "rank"
GPU_FACT = "gpu_fact"
SIDE_ROUTES = {
    TRAINING_STEP_WORK.name: Route(RANK, None, {}),
    GPU_CLOCK.name: Route(GPU_FACT, CLOCK_DOMAIN, {}),
    GPU_THROTTLE.name: Route(GPU_FACT, THROTTLE_REASON, {}),
    GPU_PCIE.name: Route(GPU_FACT, IO_DIRECTION, {}),
}
ROUTES = {**_routes(), **SIDE_ROUTES}  # metric name -> route
# (subject kind, field) of the series that each count one process holding their GPU
COUNTED = frozenset(
    (v.subject, ROW_FIELDS.index(v.field))
    for c in FEEDS
    if c.how == COUNT
    for v in FEEDS
    if v.signal == c.signal and v.how == VALUE
)
_SELECT_KEYS = frozenset(r.key for r in ROUTES.values() if r.key is not None)

# The resource attribute naming the job a reporter belongs to (core/job_identity.py), and the
# reporter's rank in it (resource/job.py).
JOB_ID_KEY = "otel_gpu.job.id"
JOB_RANK_KEY = "otel_gpu.job.rank"
# Resource attributes that identify a reporter, in the order they appear in subject names.
IDENTITY_KEYS = (
    "service.namespace",
    "service.name",
    "service.instance.id",
    "k8s.namespace.name",
    "k8s.pod.name",
    "host.name",
    "host.id",
    "process.pid",
)
_MAX_VALUE_CHARS = 128  # attribute values used in subject names are cut to this length
_MAX_CACHE = 50_000  # entries per cache before it is cleared
# New attribute sets of one metric of one resource refused by the series caps, within one
# request, after which its further new sets are counted as overflow without being parsed: a cardinality bomb
# then costs the detection lock a dictionary lookup per point, not a parse.
_FLOOD_REFUSALS = 64
# Bytes of keys per cache before it is cleared: a client sending a new 4 MB resource with every
# request must not grow the processor by 4 MB a request.
_MAX_CACHE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ResourceInfo:
    """Who reported: ``label`` names the reporter in subject names; ``attrs`` go on outputs."""

    label: str
    attrs: tuple[tuple[str, str | int], ...]
    # The job the reporter belongs to: its otel_gpu.job.id, else the label without process.pid,
    # so the phase and step a trainer process reports also apply to the GPUs an agent process
    # beside it reports.
    job: str = ""
    rank: int | None = None  # otel_gpu.job.rank: the reporter's place in its job


@dataclass(frozen=True, slots=True)
class PointAttrs:
    """The point attributes the detectors key on (None when absent)."""

    hw_id: str | None
    pid: int | None
    gpu_index: int | None
    phase: str | None  # training.phase attribute
    selectors: dict[str, str]  # values of the attributes that select a route's field


class Sink(Protocol):
    """Where decoded points go (the Assembler). Targets are opaque handles the decoder caches
    per (reporter, metric, attribute set) until ``generation`` changes."""

    generation: int
    overflow: int

    def target(
        self, res: ResourceInfo, kind: str, hw_id: str | None, pid: int | None, fld: int
    ) -> object | None: ...  # None: refused by the series cap

    def put(self, target: Any, time_ns: int, value: float) -> None: ...

    def put_job(self, res: ResourceInfo, time_ns: int, fld: int, value: float | str) -> None: ...

    def put_work(self, res: ResourceInfo, time_ns: int, value: float) -> None: ...

    def put_fact(
        self, hw_id: str, metric: str, selector: str, time_ns: int, value: float
    ) -> None: ...


_SKIP = object()  # a routed metric's point the detectors do not use (e.g. encoder utilization)
_OVERFLOW = object()  # its subject was refused by the series cap
_REPARSE = object()  # a data point not in the usual layout: parse it in full

# Tags of a NumberDataPoint's fixed-width fields: 0x11 start_time_unix_nano, 0x19
# time_unix_nano, 0x21 as_double, 0x31 as_int (field number << 3 | wire type 1, 64-bit).
_VALUE_TAGS = (0x21, 0x31)
_Key = bytes | tuple[bytes, ...]
# AggregationTemporality: 1 DELTA, 2 CUMULATIVE (0 UNSPECIFIED is read as before: lenient).
_CUMULATIVE = 2
_KNOWN_TEMPORALITIES = (0, 1, 2)
_U64 = struct.Struct("<Q").unpack_from
_F64 = struct.Struct("<d").unpack_from
_I64 = struct.Struct("<q").unpack_from


@dataclass(slots=True)
class Decoded:
    """What one request held: counts, and where its rejected points are."""

    points: int = 0  # routed points accepted
    rejected: int = 0
    ignored: int = 0  # routed points forwarded but not judged (see the module doc)
    first_error: str = ""
    overflow: int = 0  # points of subjects the series caps refused (set by the caller)
    # (resource_metrics, scope_metrics, metric, data_point) indexes of rejected points
    bad: list[tuple[int, int, int, int]] = field(default_factory=list)


def _any_value(v: AnyValue) -> str | int | float | bool | None:
    kind = v.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(v, kind)  # type: ignore[no-any-return]
    return None


def _cut(value: object) -> str:
    s = str(value)
    return s if len(s) <= _MAX_VALUE_CHARS else s[:_MAX_VALUE_CHARS] + "…"


def resource_info(raw: bytes) -> ResourceInfo:
    """Identity of a resource from its encoded bytes (unknown parts ignored)."""
    try:
        res = Resource.FromString(raw)
    except DecodeError:
        res = Resource()
    found: dict[str, str | int] = {}
    job_id: str | None = None
    rank: int | None = None
    for kv in res.attributes:
        if kv.key == JOB_ID_KEY and job_id is None:
            v = _any_value(kv.value)
            if isinstance(v, str) and v:
                job_id = _cut(v)
        elif kv.key == JOB_RANK_KEY and rank is None:
            v = _any_value(kv.value)
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31:
                rank = v
        if kv.key in IDENTITY_KEYS and kv.key not in found:
            v = _any_value(kv.value)
            if isinstance(v, (str, int)) and not isinstance(v, bool):
                found[kv.key] = v if isinstance(v, int) else _cut(v)
    attrs = tuple((k, found[k]) for k in IDENTITY_KEYS if k in found)
    if attrs:
        label = ",".join(f"{k}={v}" for k, v in attrs)
        job = ",".join(f"{k}={v}" for k, v in attrs if k != "process.pid") or label
        if job_id is not None:
            # The job's key (core/job_identity.py): every process of it, whatever its own
            # service.instance.id, joins one job here.
            job = f"{JOB_ID_KEY}={job_id}"
    else:
        # Nothing identifies the reporter: name it by its resource bytes so that two
        # anonymous reporters still get separate subjects.
        label = job = "resource=" + hashlib.blake2b(raw, digest_size=6).hexdigest()
    return ResourceInfo(label, attrs, job, rank)


def point_attrs(encoded: Iterable[bytes]) -> PointAttrs:
    """Pick hw.id, process.pid, gpu.index, training.phase and the routes' selecting attributes
    (hw.gpu.task, error.type) from KeyValues."""
    hw_id = phase = None
    pid = gpu_index = None
    selectors: dict[str, str] = {}
    for raw in encoded:
        try:
            kv = KeyValue.FromString(raw)
        except DecodeError:
            continue
        key = kv.key
        if key == HW_ID:
            v = _any_value(kv.value)
            hw_id = None if v is None else _cut(v)
        elif key == PROCESS_PID:
            v = _any_value(kv.value)
            if isinstance(v, int) and not isinstance(v, bool):
                pid = v
            elif isinstance(v, str) and v.isdigit() and len(v) < 20:
                pid = int(v)
        elif key == GPU_INDEX:
            v = _any_value(kv.value)
            if isinstance(v, int) and not isinstance(v, bool):
                gpu_index = v
        elif key == PHASE:
            phase = _cut(_any_value(kv.value))
        elif key in _SELECT_KEYS:
            selectors[key] = _cut(_any_value(kv.value))
    return PointAttrs(hw_id, pid, gpu_index, phase, selectors)


class MetricsDecoder:
    """Reads the routed series of OTLP metrics requests into a :class:`Sink`. Not thread-safe."""

    def __init__(
        self, min_time_unix_s: float, max_future_s: float, cache_bytes: int = _MAX_CACHE_BYTES
    ) -> None:
        self._min_ns = int(min_time_unix_s * 1e9)
        self._max_future_ns = int(max_future_s * 1e9)
        self._cache_bytes = cache_bytes  # bound on the key bytes of each cache
        self._resources: dict[bytes, ResourceInfo] = {}
        self._resource_bytes = 0
        # reporter label -> metric name -> attributes -> target / _SKIP / job tuple / _REPARSE;
        # attributes as a data point's encoded tail (fast path) or a tuple of encoded KeyValues
        self._targets: dict[str, dict[str, dict[_Key, Any]]] = {}
        self._entries = 0
        self._key_bytes = 0  # bytes of the attribute keys in _targets
        self._generation = -1
        # (reporter, metric, attributes) -> (start time, value) of monotonic cumulative Sums
        self._last_sum: dict[tuple[str, str, _Key], tuple[int, float]] = {}

    def _resolve(self, sink: Sink, res: ResourceInfo, route: Route, pa: PointAttrs) -> Any:
        """What to do with points of this attribute set (cached by the caller)."""
        if route.kind == RANK:
            return ("work",) if res.rank is not None else _SKIP
        if route.kind == GPU_FACT:
            selector = pa.selectors.get(route.key or "")
            if (
                pa.hw_id is None
                or selector is None
                or (route.key == CLOCK_DOMAIN and selector != "sm")
            ):
                return _SKIP
            return ("fact", pa.hw_id, route.key, selector)
        fld = route.fields.get(None if route.key is None else pa.selectors.get(route.key))
        if fld is None:
            return _SKIP  # e.g. encoder utilization, corrected ECC errors
        kind = route.kind
        if kind == JOB:
            if fld == F_PHASE:
                return _SKIP if pa.phase is None else ("phase", pa.phase)
            # loss and grad_norm are not judged here (the in-process agent and analyze judge
            # them, per step): they must not reach the job's step either
            return ("step",) if fld == F_STEP else _SKIP
        if kind == DEVICE:
            if pa.hw_id is None:
                return _SKIP
        elif kind == PROCESS_GPU:
            if pa.pid is None or pa.hw_id is None:
                return _SKIP
        elif kind == TORCH:
            # torch's allocator is reported by the process itself: the resource names it.
            device = pa.hw_id or (
                None if pa.gpu_index is None else f"{GPU_INDEX_PREFIX}{pa.gpu_index}"
            )
            return sink.target(res, kind, device, pa.pid, fld) or _OVERFLOW
        elif pa.pid is None:
            return _SKIP
        target = sink.target(res, kind, pa.hw_id, pa.pid, fld)
        return _OVERFLOW if target is None else target

    def decode(self, raw: bytes, sink: Sink, now_ns: int) -> Decoded:
        """Parse ``raw`` and feed its routed points to ``sink``. DecodeError if malformed."""
        req = MetricsRequestView.FromString(raw)
        out = Decoded()
        if (
            sink.generation != self._generation
            or self._entries > _MAX_CACHE
            or self._key_bytes > self._cache_bytes
        ):
            self._targets.clear()
            self._last_sum.clear()
            self._entries = self._key_bytes = 0
            self._generation = sink.generation
        lo, hi = self._min_ns, now_ns + self._max_future_ns
        routes, resources, targets = ROUTES, self._resources, self._targets
        isfinite = math.isfinite
        put = sink.put
        accepted = 0
        for ri, rm in enumerate(req.resource_metrics):
            res: ResourceInfo | None = None
            by_metric: dict[str, dict[_Key, Any]] = {}
            for si, sm in enumerate(rm.scope_metrics):
                for mi, metric in enumerate(sm.metrics):
                    name = metric.name
                    route = routes.get(name)
                    if route is None:
                        continue
                    data = metric.gauge or metric.sum
                    if not data:
                        continue  # histogram, summary... or empty: not ours to judge
                    if res is None:
                        rraw = rm.resource
                        res = resources.get(rraw)
                        if res is None:
                            if (
                                len(resources) >= _MAX_CACHE
                                or self._resource_bytes > self._cache_bytes
                            ):
                                resources.clear()
                                self._resource_bytes = 0
                            res = resources[rraw] = resource_info(rraw)
                            self._resource_bytes += len(rraw)
                        by_metric = targets.setdefault(res.label, {})
                    cache = by_metric.get(name)
                    if cache is None:
                        cache = by_metric[name] = {}
                    refused = 0  # new attribute sets the caps refused (see _FLOOD_REFUSALS)
                    points = NumberDataRawView.FromString(data)
                    temporality = points.aggregation_temporality
                    if temporality not in _KNOWN_TEMPORALITIES:
                        out.ignored += len(points.data_points)
                        continue
                    counter = points.is_monotonic and temporality == _CUMULATIVE
                    for di, b in enumerate(points.data_points):
                        # Fast path: the fixed-width head SDKs write (start time, time, value)
                        # read in place; the rest, the attributes, is the cache key as is.
                        o = 9 if b[:1] == b"\x11" else 0
                        if len(b) >= o + 18 and b[o] == 0x19 and b[o + 9] in _VALUE_TAGS:
                            start = _U64(b, 1)[0] if o else 0
                            t = _U64(b, o + 1)[0]
                            v = (_F64 if b[o + 9] == 0x21 else _I64)(b, o + 10)[0] or 0
                            key: Any = b[o + 18 :]
                            tg = cache.get(key)
                            if tg is None and refused < _FLOOD_REFUSALS and not _plain_tail(key):
                                tg = cache[key] = _REPARSE  # more than attributes follow
                                self._entries += 1  # (the cache stays bounded)
                                self._key_bytes += len(key)
                            has_value = True
                        else:
                            tg = _REPARSE
                        if tg is _REPARSE:
                            dp = NumberDataPointView.FromString(b)
                            start = dp.start_time_unix_nano
                            t = dp.time_unix_nano
                            v = dp.as_double or dp.as_int
                            has_value = dp.WhichOneof("value") is not None
                            key = tuple(dp.attributes)
                            tg = cache.get(key)
                        if not (lo < t < hi) or not isfinite(v) or not has_value or start > t:
                            out.rejected += 1
                            out.bad.append((ri, si, mi, di))
                            if not out.first_error:
                                out.first_error = _why(name, start, t, v, lo, hi)
                            continue
                        if counter and self._decreased(res.label, name, key, start, v):
                            out.ignored += 1
                            continue
                        accepted += 1
                        if tg is None:
                            if refused >= _FLOOD_REFUSALS:
                                sink.overflow += 1  # still flooding: counted, not parsed
                                continue
                            attrs = key if type(key) is tuple else _tail_attrs(key)
                            tg = cache[key] = self._resolve(sink, res, route, point_attrs(attrs))
                            self._entries += 1
                            self._key_bytes += sum(map(len, attrs))
                            if tg is _OVERFLOW:
                                refused += 1
                        if tg is _SKIP:
                            continue
                        if tg is _OVERFLOW:
                            sink.overflow += 1
                        elif type(tg) is tuple:
                            tag = tg[0]
                            if tag == "phase":
                                if v > 0:
                                    sink.put_job(res, t, F_PHASE, tg[1])
                            elif tag == "step":
                                sink.put_job(res, t, F_STEP, float(v))
                            elif tag == "work":
                                sink.put_work(res, t, float(v))
                            else:
                                sink.put_fact(tg[1], tg[2], tg[3], t, float(v))
                        else:
                            put(tg, t, float(v))
        out.points = accepted
        return out

    def _decreased(self, reporter: str, name: str, key: _Key, start: int, v: float) -> bool:
        """Whether a monotonic cumulative Sum's point is below the last one of its series and
        start time (a new start time is a reset, allowed); remembers the highest seen."""
        series = (reporter, name, key)
        last = self._last_sum.get(series)
        if last is not None and last[0] == start and v < last[1]:
            return True
        if last is None:
            self._entries += 1
        self._last_sum[series] = (start, v)
        return False


def _why(name: str, start: int, t: int, v: float, lo: int, hi: int) -> str:
    if not math.isfinite(v):
        return f"{name}: value {v} is not a finite number"
    if not lo < t < hi:
        return f"{name}: timestamp {t} ns is outside the accepted range"
    if start > t:
        return f"{name}: start time {start} ns is after the point's time {t} ns"
    return f"{name}: data point has no value"


def _tail_attrs(tail: bytes) -> list[bytes]:
    """The encoded KeyValues of a data point's tail (DecodeError if malformed)."""
    return list(NumberDataPointView.FromString(tail).attributes)


def _plain_tail(tail: bytes) -> bool:
    """True when ``tail`` is nothing but attributes, canonically encoded, so that the head
    read in place holds the point's only time and value (else the point is parsed in full)."""
    attrs = _tail_attrs(tail)
    return NumberDataPointView(attributes=attrs).SerializeToString() == tail  # type: ignore[no-any-return]


def strip_rejected(raw: bytes, bad: Iterable[tuple[int, int, int, int]]) -> bytes:
    """Re-encode ``raw`` without the data points at ``bad`` (the rare slow path); fields this
    OTLP version does not know are kept (protobuf carries unknown fields through)."""
    req = ExportMetricsServiceRequest.FromString(raw)
    by_metric: dict[tuple[int, int, int], list[int]] = {}
    for ri, si, mi, di in bad:
        by_metric.setdefault((ri, si, mi), []).append(di)
    for (ri, si, mi), indexes in by_metric.items():
        metric = req.resource_metrics[ri].scope_metrics[si].metrics[mi]
        data = getattr(metric, metric.WhichOneof("data"))  # gauge, sum or histogram
        for di in sorted(indexes, reverse=True):
            del data.data_points[di]
    return req.SerializeToString()
