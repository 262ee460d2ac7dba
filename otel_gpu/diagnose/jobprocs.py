"""The processes of one job, from any one of them: the launcher (torchrun, the wrapper's job)
or a rank, by ``/proc`` (same user only: another user's environment is not readable).

A *rank* is a process with ``RANK`` in its environment whose parent does not have the same
``RANK`` (a DataLoader worker inherits its rank's environment: it is that rank's *worker*).
A job without ranks (one process) is its Python processes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from otel_gpu.core.runtime_dir import RUNTIME_DIR_ENV, runtime_dir

PROC = "/proc"
_MAX_ENVIRON = 1 << 20


@dataclass(frozen=True, slots=True)
class JobProcess:
    """One process of the job as the diagnosis names it."""

    pid: int
    rank: int | None  # None: not a rank (a single-process job)
    worker: bool  # a DataLoader (or other forked) worker of ``rank``
    environ: dict[str, str]

    def label(self) -> str:
        if self.rank is None:
            return f"PID {self.pid}"
        return f"rank {self.rank} worker" if self.worker else f"rank {self.rank}"


def read_environ(pid: int, proc: str = PROC) -> dict[str, str] | None:
    """The process's environment; None when it is gone or not ours to read."""
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as f:
            raw = f.read(_MAX_ENVIRON)
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def parent_of(pid: int, proc: str = PROC) -> int | None:
    try:
        with open(os.path.join(proc, str(pid), "stat"), "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (ValueError, IndexError):
        return None


def _comm(pid: int, proc: str) -> str:
    try:
        with open(os.path.join(proc, str(pid), "comm"), "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def cmdline(pid: int, proc: str = PROC) -> list[str]:
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            raw = f.read(1 << 16)
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def is_ours(argv: list[str]) -> bool:
    """otel-gpu's own helper processes (the sampling worker): not the job's."""
    return any(a == "-m" and b.startswith("otel_gpu") for a, b in zip(argv, argv[1:], strict=False))


def _exe(pid: int, proc: str) -> str:
    try:
        return os.readlink(os.path.join(proc, str(pid), "exe"))
    except OSError:
        return ""


def is_python(pid: int, proc: str = PROC) -> bool:
    return "python" in os.path.basename(_exe(pid, proc)) or _comm(pid, proc).startswith(
        ("python", "pt_", "torchrun")
    )


def children_map(proc: str = PROC) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return children
    for name in names:
        if name.isdigit():
            ppid = parent_of(int(name), proc)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(name))
    return children


def _rank(env: dict[str, str] | None) -> int | None:
    raw = (env or {}).get("RANK", "")
    return int(raw) if raw.isdigit() else None


def job_root(pid: int, proc: str = PROC) -> int:
    """The launcher of the job ``pid`` belongs to: ``pid`` itself unless it is a rank (or a
    rank's worker), then the rank's parent."""
    here = pid
    for _ in range(8):  # worker -> rank -> launcher, bounded
        env = read_environ(here, proc)
        if _rank(env) is None:
            return here
        parent = parent_of(here, proc)
        if parent is None or parent <= 1:
            return here
        here = parent
    return here


def job_processes(pid: int, proc: str = PROC) -> list[JobProcess]:
    """The ranks (and their workers) of the job ``pid`` belongs to, by rank then PID; a job
    without ranks: its Python processes. Empty when ``pid`` is gone."""
    if read_environ(pid, proc) is None and not os.path.exists(os.path.join(proc, str(pid))):
        return []
    root = job_root(pid, proc)
    children = children_map(proc)
    tree: list[int] = []
    todo = [root]
    while todo and len(tree) < 4096:
        here = todo.pop()
        tree.append(here)
        todo.extend(children.get(here, ()))
    envs = {p: read_environ(p, proc) for p in tree}
    ranked: list[JobProcess] = []
    for p in tree:
        env = envs[p]
        rank = _rank(env)
        if env is None or rank is None or is_ours(cmdline(p, proc)):
            continue
        parent_env = envs.get(parent_of(p, proc) or -1)
        worker = parent_env is not None and _rank(parent_env) == rank
        ranked.append(JobProcess(p, rank, worker, env))
    if not ranked:
        ranked = [
            JobProcess(p, None, False, envs[p] or {})
            for p in tree
            if envs[p] is not None and is_python(p, proc) and not is_ours(cmdline(p, proc))
        ]
    return sorted(ranked, key=lambda j: (j.rank if j.rank is not None else -1, j.worker, j.pid))


def runtime_dirs_of(environ: dict[str, str], uid: int | None = None) -> list[str]:
    """Where a process with ``environ`` keeps its control socket and stack dumps, most likely
    first (docs/inprocess.md): its ``OTEL_GPU_RUNTIME_DIR``, its XDG one, the shared one, ours."""
    uid = os.getuid() if uid is None else uid
    dirs = []
    given = environ.get(RUNTIME_DIR_ENV, "").strip()
    if given:
        dirs.append(given)
    xdg = environ.get("XDG_RUNTIME_DIR", "").strip()
    if xdg:
        dirs.append(os.path.join(xdg, "otel-gpu"))
    tmp = environ.get("TMPDIR", "").strip() or "/tmp"
    dirs.append(os.path.join(tmp, f"otel-gpu-{uid}"))
    with contextlib.suppress(Exception):  # our own directory refused: the others may do
        dirs.append(runtime_dir({}))
    seen: list[str] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen
