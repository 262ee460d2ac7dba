"""Where a job is stuck: every process's stacks, grouped, and the collective picture, from any
one PID of the job (``otel-gpu diagnose stall``, the stall alert's diagnosis)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.diagnose import collectives, stacks
from otel_gpu.diagnose.jobprocs import PROC, JobProcess, job_processes, job_root, read_environ
from otel_gpu.diagnose.stacks import Group, ProcessStacks


class CannotLook(Exception):
    """Nothing could be seen of the job: the one-line reason (with the way out)."""


@dataclass(slots=True)
class HangReport:
    pid: int
    root: int
    processes: list[JobProcess]
    stacks: list[ProcessStacks]
    groups: list[Group]
    findings: list[collectives.Finding]
    took_s: float
    timings: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Most telling first: the grouped stacks (odd ones first), the collective findings,
        then what could not be seen."""
        out = []
        if self.groups:
            out.append(stacks.summary(self.groups))
        out.extend(f.line for f in self.findings if f.kind != collectives.NO_DUMP)
        out.extend(stacks.describe([], self.stacks))
        out.extend(f.line for f in self.findings if f.kind == collectives.NO_DUMP)
        return out

    def alert_lines(self) -> list[str]:
        """For an alert (notifiers show the first three): one line per group, the odd ones
        first, the collective findings after the first two groups, then what could not be
        seen."""
        groups = [g.line() for g in self.groups]
        found = [f.line for f in self.findings if f.kind != collectives.NO_DUMP]
        out = groups[:2] + found + groups[2:]
        out.extend(stacks.describe([], self.stacks))
        out.extend(f.line for f in self.findings if f.kind == collectives.NO_DUMP)
        return out

    def alert_data(self) -> dict[str, Any]:
        """:meth:`to_json` without every thread's frames (bounded for an alert)."""
        data = self.to_json()
        for g in data["groups"]:
            g["frames"] = g["frames"][:10]
        data["processes"] = [
            {k: p[k] for k in ("pid", "rank", "worker", "method", "error", "took_s")}
            for p in data["processes"]
        ]
        return data

    def details(self) -> list[str]:
        """One line per group with its frames (innermost first, up to five)."""
        out = []
        for g in self.groups:
            frames = " ← ".join(f"{f.function} {f.where()}" for f in g.frames[:5])
            methods = sorted({m.method or "?" for m in g.members})
            out.append(f"{g.who()}: {frames} [{', '.join(methods)}]")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "launcher_pid": self.root,
            "summary": stacks.summary(self.groups),
            "groups": [g.to_json() for g in self.groups],
            "collectives": [f.to_json() for f in self.findings],
            "processes": [s.to_json() for s in self.stacks],
            "took_s": round(self.took_s, 3),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
        }


def look(
    pid: int,
    *,
    pyspy: str | None,
    only: Sequence[str] = stacks.WAYS,
    fr: bool = True,
    proc: str = PROC,
) -> HangReport:
    """The stacks and collectives of the job ``pid`` belongs to. CannotLook when ``pid`` is
    not there or not this user's, or when not one process's stack could be had."""
    started = time.monotonic()
    if not os.path.isdir(os.path.join(proc, str(pid))):
        raise CannotLook(f"no process {pid}")
    if read_environ(pid, proc) is None:
        raise CannotLook(f"process {pid} is not this user's (its /proc entries are not readable)")
    root = job_root(pid, proc)
    procs = job_processes(pid, proc)
    if not procs:
        raise CannotLook(f"process {pid} has no Python processes in its job")
    got = stacks.collect(procs, pyspy=pyspy, proc=proc, only=only)
    t_stacks = time.monotonic() - started
    if all(s.main_thread() is None for s in got):
        raise CannotLook(f"no stack of any process of the job: {got[0].error}")
    findings: list[collectives.Finding] = []
    t_fr = 0.0
    if fr:
        t0 = time.monotonic()
        dumps, absent = collectives.collect_dumps(procs)
        alive = {jp.rank for jp in procs if jp.rank is not None and not jp.worker}
        for rank in sorted(collectives.expected_local_ranks(procs) - alive):
            absent[rank] = "no process on this node: it exited"
        if dumps:
            findings = collectives.findings(dumps, absent)
        else:
            findings = [
                f
                for f in collectives.findings({}, absent)
                if "no process" in f.line  # nothing recorded anywhere: only the dead matter
            ]
        t_fr = time.monotonic() - t0
    groups = stacks.group(got)
    took = time.monotonic() - started
    return HangReport(
        pid, root, procs, got, groups, findings, took, {"stacks": t_stacks, "collectives": t_fr}
    )
