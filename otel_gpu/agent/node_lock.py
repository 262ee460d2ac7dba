"""One sampler per node and GPU set: an ``flock`` on a file in a directory only this user can
write.

The lock is per set of visible GPUs (``CUDA_VISIBLE_DEVICES``): ``node.lock`` for all of them
(unset), ``node-<set>.lock`` otherwise (``node-0,1.lock``; the order of the list does not
matter). Two jobs on different GPUs each sample their own; two jobs on the same GPUs share one
sampler, which lists every process on those GPUs (the other job's too: reported, with its
memory, as a process outside the watched tree), so no job's GPU processes go unreported. A job
on all GPUs and one on a subset both sample the subset (its series twice, never none). The
holder's PID is written into the file; a process that does not sample says so once, naming it,
and exports its own spans and training metrics all the same (they never depend on the lock).

The kernel releases the lock when the owner exits, so a crashed owner never blocks the next
one. It lives in this user's private runtime directory (:mod:`otel_gpu.core.runtime_dir`), so
another user cannot take it first and switch our sampling off, and the file is opened with
``O_NOFOLLOW``: in a shared directory another user could plant a symlink at the lock's name and
have it truncate any file we can write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re

from otel_gpu.core.runtime_dir import private_problem, runtime_dir

log = logging.getLogger("otel_gpu.agent")

LOCK_FILE = "node.lock"
LOCK_PREFIX = "node"

_held: int | None = None  # the descriptor that holds this process's lock
_said = False  # "not sampling here" was said


def lock_file(visible: str | None = None) -> str:
    """The lock's file name for the GPUs ``visible`` selects (``CUDA_VISIBLE_DEVICES``)."""
    names = sorted({n.strip() for n in (visible or "").split(",") if n.strip()})
    if not names:
        return LOCK_FILE
    key = re.sub(r"[^A-Za-z0-9,-]", "_", ",".join(names))[:120]
    return f"{LOCK_PREFIX}-{key}.lock"


def holder(path: str) -> tuple[int, str] | None:
    """(PID, program name) of the process that holds the lock at ``path``, or None when nobody
    does (the PID written there is gone, or no longer has the file open)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            text = fh.read(32).strip()
        pid = int(text)
    except (OSError, ValueError):
        return None
    real = os.path.realpath(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == real:
                try:
                    with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
                        name = fh.read().strip()
                except OSError:
                    name = "?"
                return pid, name
    return None


def lock_directory(lock_dir: str | None = None) -> str:
    """``lock_dir`` (``OTEL_GPU_LOCK_DIR``), or this user's private runtime directory
    (:func:`otel_gpu.core.runtime_dir.runtime_dir`: never one another user created first)."""
    return lock_dir or runtime_dir()


def open_node_lock(
    lock_dir: str | None = None, visible: str | None = None, *, say: bool = True
) -> int | None:
    """Take the node lock of the GPUs ``visible`` selects; its descriptor (close it to
    release), or None when another process holds it or it cannot be taken safely (logged with
    the reason). ``say``: log once that this process does not sample when another holds it
    (not for the commands, which sample their own job whatever the lock)."""
    directory = lock_directory(lock_dir)
    path = os.path.join(directory, lock_file(visible))
    problem = private_problem(directory, others_may_read=True)
    if problem:
        log.warning(
            "cannot use the node lock directory %s (%s); not sampling in this process "
            "(set OTEL_GPU_LOCK_DIR to a directory only you can write)",
            directory,
            problem,
        )
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        log.warning("cannot open the node lock %s (%s); not sampling in this process", path, why)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        if say:
            _say_not_sampling(path, visible)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _is_ancestor(pid: int, depth: int = 32) -> bool:
    """Whether ``pid`` is a parent, grandparent, ... of this process."""
    current = os.getppid()
    for _ in range(depth):
        if current == pid:
            return True
        if current <= 1:
            return False
        try:
            with open(f"/proc/{current}/stat", encoding="ascii", errors="replace") as fh:
                current = int(fh.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _say_not_sampling(path: str, visible: str | None) -> None:
    global _said
    if _said:
        return
    _said = True
    found = holder(path)
    if found is not None and _is_ancestor(found[0]):
        return  # the wrapper that started this job (otel-gpu run) samples it: nothing to say
    who = f"PID {found[0]} ({found[1]})" if found else "another otel-gpu process"
    gpus = f"GPUs {visible}" if visible and visible.strip() else "this node's GPUs"
    log.warning(
        "otel-gpu: not sampling GPUs in PID %d: %s already samples %s (lock %s); this "
        "process still exports its own spans and training metrics",
        os.getpid(),
        who,
        gpus,
        path,
    )


def acquire_node_lock(
    lock_dir: str | None = None, visible: str | None = None, *, say: bool = True
) -> bool:
    """Take the per-user lock of the GPUs ``visible`` selects (``CUDA_VISIBLE_DEVICES``; None:
    all); True if this process now samples them. Held for the life of the process."""
    global _held
    if _held is None:
        _held = open_node_lock(lock_dir, visible, say=say)
    return _held is not None
