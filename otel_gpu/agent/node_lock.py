"""One sampler per node: an ``flock`` on a file in a directory only this user can write.

The kernel releases the lock when the owner exits, so a crashed owner never blocks the next
one. It lives in this user's private runtime directory (:mod:`otel_gpu.core.runtime_dir`), so
another user cannot take it first and switch our sampling off, and the file is opened with
``O_NOFOLLOW``: in a shared directory another user could plant a symlink at the lock's name and
have it truncate any file we can write.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from otel_gpu.core.runtime_dir import private_problem, runtime_dir

log = logging.getLogger("otel_gpu.agent")

LOCK_FILE = "node.lock"

_held: int | None = None  # the descriptor that holds this process's lock


def lock_directory(lock_dir: str | None = None) -> str:
    """``lock_dir`` (``OTEL_GPU_LOCK_DIR``), or this user's private runtime directory
    (:func:`otel_gpu.core.runtime_dir.runtime_dir`: never one another user created first)."""
    return lock_dir or runtime_dir()


def open_node_lock(lock_dir: str | None = None) -> int | None:
    """Take the node lock; its descriptor (close it to release), or None when another process
    holds it or it cannot be taken safely (logged with the reason)."""
    directory = lock_directory(lock_dir)
    path = os.path.join(directory, LOCK_FILE)
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
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def acquire_node_lock(lock_dir: str | None = None) -> bool:
    """Take the per-node (per-user, per-temp-dir) lock; True if this process now owns the node.

    Held for the life of the process.
    """
    global _held
    if _held is None:
        _held = open_node_lock(lock_dir)
    return _held is not None
