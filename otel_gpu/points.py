"""The agent's detection points, derived from the signal contract.

:func:`snapshot_points` turns one of the agent's snapshots into a point per subject,
reading each sample field that :data:`otel_gpu.signals.FEEDS` routes to a Point field through
the instrument that exports the signal (``metrics.INSTRUMENTS``), so the agent's detectors read
exactly what the agent exports and what the processor reads from it.

Subjects: ``gpu:<uuid>`` (a device's memory, utilization, power, temperature, errors),
``process:<pid>@<uuid>`` (one process's memory on one GPU), ``rss:<pid>`` (a watched process's
host RSS).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from otel_gpu.detect.model import Point, point
from otel_gpu.detect.subject import (
    GPU,
    PROCESS_GPU,
    PROCESS_RSS,
    local_name,
    subject_attributes,
)
from otel_gpu.metrics import INSTRUMENTS
from otel_gpu.sampling.snapshot import STATUS_OK, Snapshot
from otel_gpu.signals import OF_GPU, VALUE, Feed, feeds

Fields = tuple[tuple[str, str], ...]  # (Point field, sample field)


def _sample_field(feed: Feed) -> str:
    """The sample field the agent exports as the series of ``feed.signal`` that feeds it."""
    for spec in INSTRUMENTS:
        if spec.signal == feed.signal:
            found = [name for name, extra in spec.sources if feed.accepts(dict(extra))]
            if len(found) == 1:
                return found[0]
    raise LookupError(f"no sample field of {feed.signal.name} feeds Point.{feed.field}")


def _fields(subject: str, how: str = VALUE) -> Fields:
    return tuple((f.field, _sample_field(f)) for f in feeds(subject, how))


_GPU = _fields(GPU)  # from a GpuSample
_PROCESS_GPU = _fields(PROCESS_GPU)  # from a GpuProcessSample
_OF_GPU = _fields(PROCESS_GPU, OF_GPU)  # from the GpuSample of the process's GPU
_RSS = _fields(PROCESS_RSS)  # from a ProcessSample


def snapshot_points(
    snap: Snapshot,
    phase: str | None = None,
    step: float | None = None,
    host_memory: int | None = None,
) -> Iterator[tuple[str, Point, dict[str, Any]]]:
    """The detector inputs of one snapshot: (subject, point, attributes for the outputs)."""
    per_gpu: dict[str, int] = {}
    for gp in snap.gpu_processes:
        per_gpu[gp.gpu_uuid] = per_gpu.get(gp.gpu_uuid, 0) + 1
    by_uuid = {g.uuid: g for g in snap.gpus}
    for g in snap.gpus:
        if g.status != STATUS_OK:
            continue
        values = {field: getattr(g, name) for field, name in _GPU}
        # Unknown (not 0) when NVML could not list processes: 0 would read as "released".
        values["procs"] = per_gpu.get(g.uuid, 0) if g.processes_listed else None
        yield (
            local_name(GPU, g.uuid, None),
            point(snap.time, {**values, "phase": phase, "step": step}),
            dict(subject_attributes(GPU, g.uuid, None)),
        )
    for gp in snap.gpu_processes:
        values = {field: getattr(gp, name) for field, name in _PROCESS_GPU}
        if values["used_bytes"] is None:
            continue
        device = by_uuid.get(gp.gpu_uuid)
        for field, name in _OF_GPU:
            values[field] = None if device is None else getattr(device, name)
        yield (
            local_name(PROCESS_GPU, gp.gpu_uuid, gp.pid),
            point(snap.time, {**values, "phase": phase}),
            dict(subject_attributes(PROCESS_GPU, gp.gpu_uuid, gp.pid)),
        )
    for p in snap.processes:
        if not p.in_tree:
            continue
        values = {field: getattr(p, name) for field, name in _RSS}
        if values["used_bytes"] is None:
            continue
        yield (
            local_name(PROCESS_RSS, None, p.pid),
            point(snap.time, {**values, "limit_bytes": host_memory, "phase": phase}),
            dict(subject_attributes(PROCESS_RSS, None, p.pid)),
        )
