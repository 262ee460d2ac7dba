"""A GPU that falls off: the job-level alert naming the GPU and the ranks that used it. Pure.

A GPU is lost when NVML reports it failed (GPU_IS_LOST, reset required), when its UUID is no
longer enumerated while NVML still answers (the device count dropped, or another GPU took its
index), or when its last Xid is 79 ("fallen off the bus", also read from the kernel log). The
job cannot go on on that GPU: one critical ``hardware`` alert per loss, on the GPU's subject,
naming the GPU (UUID and index), how it was lost, and the processes and ranks that held it at
the last sweep it was seen healthy; the loss re-arms once the GPU is back and healthy.

Fed one sweep at a time with plain data (the agent converts its snapshots), so it imports
neither the sampler nor the agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from otel_gpu.detect.model import HARDWARE, Alert

FALLEN_OFF = 79


@dataclass(frozen=True, slots=True)
class GpuSeen:
    """One GPU in one sweep."""

    uuid: str
    index: int
    failed: bool = False
    xid_last: int | None = None


@dataclass(frozen=True, slots=True)
class GpuUser:
    """A process holding a GPU: its PID and, when known, its rank."""

    pid: int
    rank: int | None = None
    name: str | None = None

    def __str__(self) -> str:
        who = f"rank {self.rank} (pid {self.pid})" if self.rank is not None else f"pid {self.pid}"
        return f"{who} {self.name}" if self.name else who


class LostGpus:
    """Remembers the GPUs seen and who used them; ``observe`` returns the losses that start."""

    def __init__(self, max_gpus: int = 1024) -> None:
        self._known: dict[str, tuple[int, tuple[GpuUser, ...]]] = {}
        self._lost: set[str] = set()
        self._count: int | None = None
        self._max = max_gpus

    def observe(
        self,
        time: float,
        gpus: Sequence[GpuSeen],
        users: Mapping[str, Sequence[GpuUser]],
        nvml_answers: bool = True,
    ) -> list[Alert]:
        """One sweep: the GPUs NVML enumerated, the processes on each. ``nvml_answers``: False
        while NVML itself is unavailable (every GPU missing then says nothing about any one)."""
        out: list[Alert] = []
        present = {g.uuid for g in gpus}
        count_before = self._count
        if nvml_answers:
            self._count = len(gpus)
        for g in gpus:
            if not g.failed:
                self._lost.discard(g.uuid)
                held = tuple(users.get(g.uuid, ()))
                prev = self._known.get(g.uuid)
                # keep the last users seen: a GPU that fails mid-sweep lists none any more
                self._known[g.uuid] = (g.index, held or (prev[1] if prev else ()))
                continue
            if g.uuid in self._lost:
                continue
            self._lost.add(g.uuid)
            how = (
                "fallen off the bus (Xid 79)"
                if g.xid_last == FALLEN_OFF
                else "lost (NVML: GPU_IS_LOST)"
            )
            out.append(self._alert(time, g.uuid, g.index, how))
        if nvml_answers:
            for uuid in [u for u in self._known if u not in present]:
                index, _ = self._known[uuid]
                if uuid not in self._lost:
                    self._lost.add(uuid)
                    if count_before is not None and len(gpus) < count_before:
                        how = f"gone: the GPUs NVML enumerates fell from {count_before} to {len(gpus)}"
                    else:
                        how = "gone: its UUID is no longer enumerated"
                    out.append(self._alert(time, uuid, index, how))
                del self._known[uuid]
        while len(self._known) > self._max:
            del self._known[next(iter(self._known))]
        if len(self._lost) > self._max:
            self._lost = set(list(self._lost)[-self._max :])
        return out

    def _alert(self, time: float, uuid: str, index: int, how: str) -> Alert:
        _index, held = self._known.get(uuid, (index, ()))
        if held:
            ranks = sorted({u.rank for u in held if u.rank is not None})
            whom = "; the job's " + ", ".join(str(u) for u in held[:16])
            whom += (
                f" lost their GPU (ranks {', '.join(map(str, ranks))})"
                if ranks
                else " lost their GPU"
            )
        else:
            whom = "; no process of the job held it at the last sweep"
        evidence: dict[str, float | str] = {
            "rule": "gpu_lost",
            "scope": "job",
            "gpu": uuid,
            "gpu_index": float(index),
            "how": how,
            "action": "drain / reset the GPU (or reboot the node); restart the job elsewhere",
        }
        if held:
            evidence["pids"] = ",".join(str(u.pid) for u in held)
            ranks_text = ",".join(str(u.rank) for u in held if u.rank is not None)
            if ranks_text:
                evidence["ranks"] = ranks_text
        return Alert(
            kind=HARDWARE,
            subject=f"gpu:{uuid}",
            time=time,
            severity="critical",
            message=f"GPU {index} ({uuid}) is {how}{whom}: the job cannot continue on it",
            evidence=evidence,
        )
