"""Every file and directory we create is this user's alone: directories 0700, files 0600
(issue 18.13), whatever the umask.

What we write holds what others must not read: the processor's forward queue keeps every
request verbatim (resource attributes, command lines), its state the alert history, a
recording or summary the job's processes and names. So each is created private:

- :func:`private_dir` creates missing directories 0700 (an existing one is left as it is,
  except :func:`tighten_dir` on a directory that holds only our own files);
- :func:`open_private` opens a file for writing, creating it 0600 (``O_CREAT`` with that
  mode; an existing file keeps its mode: a path the user chose, e.g. ``/dev/full`` or a
  shared folder's file, is theirs);
- :func:`private_file` creates (or tightens, if it is ours) a file a library opens itself
  afterwards: SQLite gives its ``-wal`` and ``-shm`` files the database's mode.

The runtime directory (``core/runtime_dir.py``), the node lock and the control sockets follow
the same rule on their own (0700, 0600).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from typing import IO, Any

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str) -> str:
    """``path`` and its missing parents, created 0700; returns ``path``. Raises OSError."""
    missing = []
    here = os.path.abspath(path)
    while not os.path.isdir(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(folder, DIR_MODE)
            os.chmod(folder, DIR_MODE)  # the umask may have taken bits: never added any
    return path


def tighten_dir(path: str, ours: Callable[[str], bool]) -> None:
    """Make ``path`` 0700 when it is this user's, not a shared (sticky) directory, and every
    entry in it satisfies ``ours`` (a directory given to us alone, e.g. ``--queue-dir``, made
    by someone with a looser umask). Anything else is left alone; never raises."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
            return
        if stat.S_IMODE(st.st_mode) & 0o077 and all(ours(name) for name in os.listdir(path)):
            os.chmod(path, DIR_MODE)


def open_private(path: str, mode: str = "w", **kwargs: Any) -> IO[Any]:
    """``open(path, mode, **kwargs)`` for writing, a new file created 0600. Raises OSError."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
    fd = os.open(path, flags, FILE_MODE)
    try:
        return open(fd, mode, **kwargs)  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def private_file(path: str, create: bool = True) -> str:
    """Make sure ``path`` exists and is 0600 before a library (SQLite) opens it: created
    0600 (unless not ``create``: then only an existing file is seen to), or tightened when it
    is this user's regular file; returns ``path``. Raises OSError when it cannot be opened."""
    if not create and not os.path.lexists(path):
        return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return path
