"""The user's private runtime directory: where the node lock, the trainers' control sockets,
stack dumps and OOM post-mortems live.

Only this user may read or write it (mode 0700, owned by this user, not a symbolic link), so
another local user can neither plant files there nor read what we write. Resolution, first
that is usable wins:

1. ``OTEL_GPU_RUNTIME_DIR`` — set by a wrapper (``otel-gpu run``) or an instrumented process
   for the processes it starts, so a whole job shares one directory;
2. ``$XDG_RUNTIME_DIR/otel-gpu`` (systemd's per-user ``/run/user/<uid>``, private by design);
3. ``<temp dir>/otel-gpu-<uid>``, created 0700 when missing;
4. a fresh ``<temp dir>/otel-gpu-<uid>-XXXXXX`` (mkdtemp: private by construction), when 3 is
   unusable — e.g. another user created it first to switch our sampling off. It is exported in
   ``OTEL_GPU_RUNTIME_DIR`` so that this process's children use it too.

A directory that is not private is never used, and the reason is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
from collections.abc import MutableMapping

log = logging.getLogger("otel_gpu")

RUNTIME_DIR_ENV = "OTEL_GPU_RUNTIME_DIR"

_lock = threading.Lock()
_resolved: str | None = None
_warned: set[str] = set()


def private_problem(path: str, *, others_may_read: bool = False) -> str | None:
    """Why ``path`` is not a directory only this user can use, or None when it is.
    ``others_may_read``: group and others may read and list it, not write (the node lock's
    directory a user names with ``OTEL_GPU_LOCK_DIR``)."""
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
    if st.st_mode & (0o022 if others_may_read else 0o077):
        verb = "write to" if others_may_read else "use"
        return f"others can {verb} it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _usable(path: str, create: bool) -> bool:
    if create:
        with contextlib.suppress(OSError):
            os.mkdir(path, 0o700)
    problem = private_problem(path)
    if problem is None:
        return True
    if path not in _warned and os.path.lexists(path):
        _warned.add(path)
        log.warning("otel-gpu: not using %s (%s); using a private directory instead", path, problem)
    return False


def runtime_dir(env: MutableMapping[str, str] | None = None) -> str:
    """This user's private runtime directory (see the module docstring); the same for the
    life of the process. ``env`` (default: ``os.environ``) receives ``OTEL_GPU_RUNTIME_DIR``
    when a fresh directory had to be made."""
    global _resolved
    env = os.environ if env is None else env
    with _lock:
        if _resolved is not None and private_problem(_resolved) is None:
            return _resolved
        _resolved = _resolve(env)
        return _resolved


def _resolve(env: MutableMapping[str, str]) -> str:
    given = env.get(RUNTIME_DIR_ENV, "").strip()
    if given and os.path.isabs(given) and _usable(given, create=True):
        return given
    xdg = env.get("XDG_RUNTIME_DIR", "").strip()
    if xdg and os.path.isabs(xdg) and private_problem(xdg) is None:
        path = os.path.join(xdg, "otel-gpu")
        if _usable(path, create=True):
            return path
    shared = os.path.join(tempfile.gettempdir(), f"otel-gpu-{os.getuid()}")
    if _usable(shared, create=True):
        return shared
    fresh = tempfile.mkdtemp(prefix=f"otel-gpu-{os.getuid()}-")
    env[RUNTIME_DIR_ENV] = fresh
    return fresh


def reset_for_tests() -> None:
    global _resolved
    with _lock:
        _resolved = None
        _warned.clear()
