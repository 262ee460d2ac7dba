"""Attributes added to the series of some GPUs and processes (the DaemonSet's ``k8s.*``).

Whoever knows them (:class:`otel_gpu.k8s.attribution.NodeAttribution`, on its own thread)
publishes one immutable :class:`SeriesLabels` at a time; the metric callbacks only look them
up. The instrument table's readers keep their one-argument form (``read(snap)``): the callback
sets the labels of the collection in progress in a context variable, and
:func:`otel_gpu.agent.instruments.gpu_attrs` / :func:`otel_gpu.agent.instruments.process_attrs` read it. A context
variable, not a module global, so that two agents in one process (tests, an in-process agent
beside a sidecar) never see each other's labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

Extra = tuple[tuple[str, Any], ...]  # hashable: part of the attribute caches' keys


@dataclass(frozen=True, slots=True)
class SeriesLabels:
    """Extra attributes by GPU or MIG UUID (``hw.id``) and by process: its PID (the agent's
    PID) with its start time (``ProcessSample.start_ticks``), so a PID reused before the next
    refresh does not carry the previous process's pod.

    A GPU or process absent from the maps gets no extra attribute (never empty strings)."""

    gpu: Mapping[str, Extra] = field(default_factory=dict)
    process: Mapping[tuple[int, int | None], Extra] = field(default_factory=dict)


NO_LABELS = SeriesLabels()

# The labels of the collection in progress on this thread (NO_LABELS outside one).
collecting: ContextVar[SeriesLabels] = ContextVar("otel_gpu_series_labels", default=NO_LABELS)
