"""The job's trainer processes: the only ones a stop may signal, guarded against PID reuse.

Trainers are the watched processes that hold GPU memory: never a launcher above them
(signalling ``swift`` or torchrun's agent orphans the ranks), never a process outside the
watched tree, and none without GPU processes (no GPU visible: nothing is signalled). Each is
remembered with its start time (clock ticks after boot, exact), which is read again just before
a stop: a PID reused since the last sweep has another start time and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from otel_gpu.sampling.snapshot import Snapshot

StartTicks = Callable[[int], int | None]  # PID -> its start time now, None when gone


def trainers_of(snap: Snapshot) -> dict[int, int | None]:
    """The trainers of one snapshot: PID -> start ticks (None when unknown)."""
    on_gpu = {snap.host_to_local.get(gp.pid, gp.pid) for gp in snap.gpu_processes}
    return {p.pid: p.start_ticks for p in snap.processes if p.in_tree and p.pid in on_gpu}


def still_the_same(trainers: Mapping[int, int | None], start_ticks: StartTicks) -> set[int]:
    """The trainers whose start time, read now, is the one they were seen with; a trainer
    seen without a start time is never verified."""
    return {
        pid
        for pid, started in trainers.items()
        if started is not None and start_ticks(pid) == started
    }


class Trainers:
    """The trainers of the latest sweep, and their verification when a stop fires."""

    def __init__(self, start_ticks: StartTicks) -> None:
        self._start_ticks = start_ticks
        self._known: dict[int, int | None] = {}

    def update(self, snap: Snapshot) -> None:
        """Take the trainers of a new sweep (on the sampler thread)."""
        self._known = trainers_of(snap)

    @property
    def pids(self) -> set[int]:
        return set(self._known)

    def verified(self) -> set[int]:
        """The trainers that are still the same processes now (start times re-read)."""
        return still_the_same(dict(self._known), self._start_ticks)
