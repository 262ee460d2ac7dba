"""The agent's detection points, derived from the signal contract.

:func:`snapshot_points` turns one of the agent's snapshots into a point per subject,
reading each sample field that :data:`otel_gpu.core.signals.FEEDS` routes to a Point field through
the instrument that exports the signal (``metrics.INSTRUMENTS``), so the agent's detectors read
exactly what the agent exports and what the processor reads from it.

Subjects: ``gpu:<uuid>`` (a device's memory, utilization, power, temperature, errors),
``process:<pid>@<uuid>`` (one process's memory on one GPU), ``rss:<pid>`` (a watched process's
host RSS).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

from otel_gpu.agent.instruments import INSTRUMENTS
from otel_gpu.core.signals import OF_GPU, VALUE, Feed, feeds
from otel_gpu.detect.model import Point, point
from otel_gpu.detect.subject import (
    GPU,
    PROCESS_GPU,
    PROCESS_RSS,
    local_name,
    subject_attributes,
)
from otel_gpu.sampling.snapshot import STATUS_OK, Snapshot


def _sample_field(feed: Feed) -> str:
    """The sample field the agent exports as the series of ``feed.signal`` that feeds it."""
    for spec in INSTRUMENTS:
        if spec.signal == feed.signal:
            found = [name for name, extra in spec.sources if feed.accepts(dict(extra))]
            if len(found) == 1:
                return found[0]
    raise LookupError(f"no sample field of {feed.signal.name} feeds Point.{feed.field}")


def _reader(subject: str, how: str = VALUE) -> Callable[[Any], dict[str, Any]]:
    """Point field -> value, read off a sample by the fields that feed ``subject``."""
    pairs = [(f.field, _sample_field(f)) for f in feeds(subject, how)]
    names = tuple(field for field, _name in pairs)
    get = attrgetter(*(name for _field, name in pairs))  # one C call for every field
    if len(pairs) == 1:
        return lambda sample: {names[0]: get(sample)}
    return lambda sample: dict(zip(names, get(sample), strict=True))


_GPU = _reader(GPU)  # from a GpuSample
_PROCESS_GPU = _reader(PROCESS_GPU)  # from a GpuProcessSample
_OF_GPU = _reader(PROCESS_GPU, OF_GPU)  # from the GpuSample of the process's GPU
_RSS = _reader(PROCESS_RSS)  # from a ProcessSample
_NO_GPU = dict.fromkeys(f.field for f in feeds(PROCESS_GPU, OF_GPU))  # its GPU not in the sweep


def snapshot_points(
    snap: Snapshot,
    phase: str | None = None,
    step: float | None = None,
    host_memory: int | None = None,
    step_pid: int | None = None,
) -> Iterator[tuple[str, Point, dict[str, Any]]]:
    """The detector inputs of one snapshot: (subject, point, attributes for the outputs).

    The job's ``step`` rides on each GPU's point; in a sweep that lists no GPU at all (a host
    without GPUs, NVML not loaded) it rides on the host-memory point of ``step_pid`` (the main
    trainer) instead, so the recording keeps its steps and a stuck step is still judged — once
    for the job, not once per process. (A GPU that NVML fails to read is still listed: the
    steps wait for it rather than hop between subjects.)"""
    on_gpu = bool(snap.gpus)
    per_gpu: dict[str, int] = {}
    for gp in snap.gpu_processes:
        per_gpu[gp.gpu_uuid] = per_gpu.get(gp.gpu_uuid, 0) + 1
    by_uuid = {g.uuid: g for g in snap.gpus}
    for g in snap.gpus:
        if g.status != STATUS_OK:
            continue
        values = _GPU(g)
        # Unknown (not 0) when NVML could not list processes: 0 would read as "released".
        values["procs"] = per_gpu.get(g.uuid, 0) if g.processes_listed else None
        values["phase"], values["step"] = phase, step
        yield (
            local_name(GPU, g.uuid, None),
            point(snap.time, values),
            dict(subject_attributes(GPU, g.uuid, None)),
        )
    for gp in snap.gpu_processes:
        values = _PROCESS_GPU(gp)
        if values["used_bytes"] is None:
            continue
        device = by_uuid.get(gp.gpu_uuid)
        values.update(_OF_GPU(device) if device is not None else _NO_GPU)
        values["phase"] = phase
        yield (
            local_name(PROCESS_GPU, gp.gpu_uuid, gp.pid),
            point(snap.time, values),
            dict(subject_attributes(PROCESS_GPU, gp.gpu_uuid, gp.pid)),
        )
    for p in snap.processes:
        if not p.in_tree:
            continue
        values = _RSS(p)
        if values["used_bytes"] is None:
            continue
        values["limit_bytes"], values["phase"] = host_memory, phase
        if not on_gpu and p.pid == step_pid:
            values["step"] = step
        yield (
            local_name(PROCESS_RSS, None, p.pid),
            point(snap.time, values),
            dict(subject_attributes(PROCESS_RSS, None, p.pid)),
        )
