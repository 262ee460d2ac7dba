"""GPU processes that outlive the job: started by it, still holding GPU memory after it ended.

A server or a data loader the job started with ``setsid`` (or ``nohup ... &``) leaves the job's
process group, so nothing ends it with the job; it keeps its GPU memory, and the next job on
that GPU runs short of it. :class:`LeftoverWatch` remembers every process seen in the job's
tree (PID and start time, so a PID reused since is not blamed), and once a sweep no longer sees
the job's root it names the remembered processes that NVML still lists on a GPU. The wrapper
says so in the summary and raises an ``orphan`` alert for each (logged, notified like any
other alert).

Runs on the sampler thread (the sweep listeners); :meth:`LeftoverWatch.job_exited` is called on
the wrapper's thread and waits, bounded, for that one sweep.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from otel_gpu.core import units
from otel_gpu.detect.model import ORPHAN, Alert
from otel_gpu.detect.subject import PROCESS_GPU, local_name
from otel_gpu.sampling.snapshot import Snapshot

MAX_MEMBERS = 4096  # processes of the tree remembered (the oldest forgotten first)


@dataclass(frozen=True)
class Leftover:
    """One process the job started, still on a GPU after the job ended."""

    pid: int  # in the agent's PID namespace
    name: str
    gpu: str  # GPU0, MIG1, ...
    used_bytes: int | None
    subject: str  # process:<NVML PID>@<uuid>

    def sentence(self) -> str:
        held = "holds GPU memory" if self.used_bytes is None else (
            f"holds {units.memory(self.used_bytes)}"
        )  # fmt: skip
        return (
            f"{self.name} (PID {self.pid}), started by the job, still runs and {held} on "
            f"{self.gpu} after the job ended: end it to free the GPU"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def leftovers(snap: Snapshot, members: dict[int, int], root: int) -> list[Leftover]:
    """The processes of ``members`` (PID -> start ticks, as seen in the tree) that ``snap``
    shows alive with the same start time, on a GPU, apart from the job's ``root``."""
    alive = {p.pid: p for p in snap.processes}
    index = {g.uuid: g.index for g in snap.gpus}
    found = []
    for gp in snap.gpu_processes:
        local = snap.host_to_local.get(gp.pid, gp.pid)
        p = alive.get(local)
        if local == root or p is None or p.start_ticks is None:
            continue
        if members.get(local) != p.start_ticks:
            continue  # never in the tree, or its PID now names another process
        found.append(
            Leftover(
                local,
                p.executable_name or "?",
                units.gpu_label(index.get(gp.gpu_uuid), gp.gpu_uuid).split()[0],
                gp.used_memory,
                local_name(PROCESS_GPU, gp.gpu_uuid, gp.pid),
            )
        )
    return found


def orphan_alert(leftover: Leftover, time: float) -> Alert:
    """The ``orphan`` alert of one leftover, at data time ``time``."""
    evidence: dict[str, float | str] = {"pid": float(leftover.pid)}
    if leftover.used_bytes is not None:
        evidence["used_bytes"] = float(leftover.used_bytes)
    return Alert(ORPHAN, leftover.subject, time, "warning", leftover.sentence(), evidence=evidence)


class LeftoverWatch:
    """Remembers the job's tree sweep by sweep; after the job ended, finds its leftovers."""

    def __init__(self, max_members: int = MAX_MEMBERS) -> None:
        self._members: OrderedDict[int, int] = OrderedDict()
        self._max = max_members
        self._root: int | None = None
        self._found: list[Leftover] | None = None
        self._done = threading.Event()
        # Called once, on the sampler thread, with what the first sweep after the job found.
        self.listeners: list[Callable[[list[Leftover], Snapshot], None]] = []

    def on_snapshot(self, snap: Snapshot) -> None:
        for p in snap.processes:
            if p.in_tree and p.start_ticks is not None:
                self._members[p.pid] = p.start_ticks
                self._members.move_to_end(p.pid)
        while len(self._members) > self._max:
            self._members.popitem(last=False)
        root = self._root
        if root is None or self._done.is_set():
            return
        if any(p.pid == root and p.in_tree for p in snap.processes):
            return  # a sweep from before the job ended
        self._found = leftovers(snap, dict(self._members), root)
        self._done.set()
        for listener in self.listeners:
            listener(self._found, snap)

    def job_exited(self, root: int, wake: Callable[[], None], timeout_s: float) -> list[Leftover]:
        """The job (its root ``root``) has ended: ask for a sweep (``wake``) and return what it
        finds, waiting at most ``timeout_s`` (nothing found then)."""
        self._root = root
        wake()
        self._done.wait(timeout_s)
        return list(self._found or ())
