"""One sampler per node: an ``flock`` on a file in a directory only this user can write.

The kernel releases the lock when the owner exits, so a crashed owner never blocks the next
one. The file is opened with ``O_NOFOLLOW`` inside a private directory: in a shared temp dir,
another user could plant a symlink at the lock's name and have it truncate any file we can
write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile

log = logging.getLogger("otel_gpu.agent")

LOCK_FILE = "node.lock"

_held: int | None = None  # the descriptor that holds this process's lock


def lock_directory(lock_dir: str | None = None) -> str:
    """``lock_dir``, or ``<temp dir>/otel-gpu-<uid>`` (created private when missing)."""
    if lock_dir:
        return lock_dir
    path = os.path.join(tempfile.gettempdir(), f"otel-gpu-{os.getuid()}")
    with contextlib.suppress(OSError):  # it exists, or private_problem() will say why not
        os.mkdir(path, 0o700)
    return path


def private_problem(path: str) -> str | None:
    """Why ``path`` is not a directory only this user can write, or None when it is."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def open_node_lock(lock_dir: str | None = None) -> int | None:
    """Take the node lock; its descriptor (close it to release), or None when another process
    holds it or it cannot be taken safely (logged with the reason)."""
    directory = lock_directory(lock_dir)
    path = os.path.join(directory, LOCK_FILE)
    problem = private_problem(directory)
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
