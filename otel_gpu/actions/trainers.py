"""The job's trainer processes: the only ones a stop may signal, guarded against PID reuse.

Trainers are the watched processes that hold GPU memory: never a launcher above them
(signalling ``swift`` or torchrun's agent orphans the ranks), never a process outside the
watched tree, and none without GPU processes (no GPU visible: nothing is signalled). Each is
remembered with its start time (clock ticks after boot, exact), which is read again just before
a stop: a PID reused since the last sweep has another start time and is left alone.

A stop also needs the alert to be the job's own problem (:meth:`Trainers.not_the_jobs`): a
leak on ``gpu:<uuid>`` counts every process on that GPU, so another tenant's growth would
otherwise stop this job. The job's subjects are its processes' (``process:<pid>@<uuid>`` of a
watched process, ``rss:<pid>``); a GPU's is the job's when only the job's processes are on it,
or, for a leak, when one of the job's processes on it is leaking too (they agree).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from otel_gpu.detect.model import LEAK, Alert
from otel_gpu.detect.subject import PROCESS_GPU, local_name
from otel_gpu.sampling.snapshot import Snapshot

StartTicks = Callable[[int], int | None]  # PID -> its start time now, None when gone


def trainers_of(snap: Snapshot) -> dict[int, int | None]:
    """The trainers of one snapshot: PID -> start ticks (None when unknown)."""
    on_gpu = {snap.host_to_local.get(gp.pid, gp.pid) for gp in snap.gpu_processes}
    return {p.pid: p.start_ticks for p in snap.processes if p.in_tree and p.pid in on_gpu}


@dataclass(frozen=True)
class GpuTenants:
    """Who holds one GPU at one sweep: the job's process subjects on it, and whether anyone
    else is there (None: NVML did not list its processes, so nobody knows)."""

    job: frozenset[str] = frozenset()
    others: tuple[int, ...] | None = ()  # host PIDs of processes outside the job


@dataclass(frozen=True)
class JobSubjects:
    """The detection subjects of one sweep that are the job's own (see the module doc)."""

    processes: frozenset[str] = frozenset()
    gpus: dict[str, GpuTenants] = field(default_factory=dict)


def job_subjects(snap: Snapshot) -> JobSubjects:
    """Whose each process and GPU subject of ``snap`` is."""
    in_tree = {p.pid for p in snap.processes if p.in_tree}
    job: dict[str, set[str]] = {}
    others: dict[str, list[int]] = {}
    for gp in snap.gpu_processes:
        if snap.host_to_local.get(gp.pid, gp.pid) in in_tree:
            job.setdefault(gp.gpu_uuid, set()).add(local_name(PROCESS_GPU, gp.gpu_uuid, gp.pid))
        else:
            others.setdefault(gp.gpu_uuid, []).append(gp.pid)
    gpus = {
        g.uuid: GpuTenants(
            frozenset(job.get(g.uuid, ())),
            tuple(others.get(g.uuid, ())) if g.processes_listed else None,
        )
        for g in snap.gpus
    }
    return JobSubjects(frozenset().union(*job.values()), gpus)


def not_the_jobs(alert: Alert, subjects: JobSubjects, leaking: Callable[[str], bool]) -> str | None:
    """Why ``alert`` is not the job's own problem, so that stopping the job would not help
    (None: it is). ``leaking(subject)``: whether that subject has an active leak now."""
    subject = alert.subject
    if subject.startswith("process:"):
        return None if subject in subjects.processes else "that process is not the job's"
    if not subject.startswith("gpu:"):
        return None  # rss:<pid> (only the job's are watched) and subjects of other hosts
    tenants = subjects.gpus.get(subject.partition(":")[2])
    if tenants is None or not tenants.job:
        return "no process of the job is on that GPU"
    if alert.kind != LEAK or tenants.others == ():
        return None  # the job is there (not a shared-memory sum), or alone there
    if any(leaking(s) for s in tenants.job):
        return None  # the job's own memory on it grows too: they agree
    if tenants.others is None:
        return "NVML does not list that GPU's processes, so whose memory grows is unknown"
    pids = ", ".join(str(p) for p in tenants.others[:5])
    return (
        f"the GPU's memory counts other processes (PID {pids}) and the job's own on it "
        "are not growing"
    )


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
        self._subjects = JobSubjects()

    def update(self, snap: Snapshot) -> None:
        """Take the trainers of a new sweep (on the sampler thread)."""
        self._known = trainers_of(snap)
        self._subjects = job_subjects(snap)

    def not_the_jobs(self, alert: Alert, leaking: Callable[[str], bool]) -> str | None:
        """Why ``alert`` (of the latest sweep) is not the job's own problem; None if it is."""
        return not_the_jobs(alert, self._subjects, leaking)

    @property
    def pids(self) -> set[int]:
        return set(self._known)

    def verified(self) -> set[int]:
        """The trainers that are still the same processes now (start times re-read)."""
        return still_the_same(dict(self._known), self._start_ticks)
