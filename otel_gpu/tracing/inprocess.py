"""The trainer side of the control channel: what otel-gpu may ask this process
(docs/inprocess.md, :mod:`otel_gpu.core.channel`).

Started by the tracing pipeline in every ``trainer`` and ``node`` process. Base operations:

- ``hello``: who this is (pid, rank, local rank, world size, version, the operations served);
- ``progress``: the phase and step now, and the step ends after the caller's ``since``
  sequence number (``[[seq, step, wall_time_s], ...]``, oldest first), the training
  numbers (``loss``, ``learning_rate``, ``grad_norm``, ``step_s``, ``samples_per_s``, ...) and
  the seconds spent in each phase (``phases_s``). Under ``otel-gpu run``
  (``OTEL_GPU_WATCHED_BY`` set) the same reply is left at exit in ``progress-<pid>.json``, so
  the steps that end after the wrapper's last poll are not lost.

- ``stacks``: every thread's Python stack (:func:`otel_gpu.diagnose.stacks.handle_stacks`);
  and, for when the interpreter cannot run that, a ``faulthandler`` dump of all threads on
  ``SIGRTMIN+6`` to ``<runtime dir>/stacks-<pid>.txt`` (``otel-gpu diagnose stall``);
- ``fr.dump``: this rank's flight-recorder collectives
  (:func:`otel_gpu.diagnose.collectives.handle_fr_dump`).

Other concerns (memory census, flight-recorder dumps) register their own operations with
:func:`register`. Handlers run on the channel's request threads, never on the job's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from otel_gpu import __version__
from otel_gpu.core.channel import (
    WATCHED_BY_ENV,
    ControlServer,
    Handler,
    last_words_path,
    socket_path,
)
from otel_gpu.core.private_files import open_private
from otel_gpu.core.runtime_dir import runtime_dir
from otel_gpu.diagnose import collectives, stacks
from otel_gpu.tracing import context, progress

log = logging.getLogger("otel_gpu.tracing")

_lock = threading.Lock()
_server: ControlServer | None = None
_pending: dict[str, Handler] = {}


def _hello(_request: Mapping[str, Any]) -> Mapping[str, Any]:
    rank = context.RankInfo.from_env()
    ops = _server.ops if _server is not None else []
    return {
        "pid": os.getpid(),
        "rank": rank.rank,
        "local_rank": rank.local_rank,
        "world_size": rank.world_size,
        "version": __version__,
        "ops": ops,
    }


def _progress(request: Mapping[str, Any]) -> Mapping[str, Any]:
    since = request.get("since", 0)
    since = since if isinstance(since, int) and since >= 0 else 0
    seq, ends = progress.step_ends_since(since)
    lost = max(0, (ends[0][0] - since - 1) if ends else 0)
    return {
        "phase": progress.current_phase(),
        "step": progress.current_step(),
        "seq": seq,
        "steps": [list(e) for e in ends],
        "lost": lost,  # step ends the ring no longer held
        "numbers": progress.numbers(),  # loss, learning_rate, grad_norm, step_s, ..._per_s
        "phases_s": progress.phase_seconds(),  # seconds in each phase so far
    }


def _leave_last_words(directory: str, pid: int) -> None:
    """At exit, under ``otel-gpu run``: this process's final progress (every step end the ring
    holds) in ``progress-<pid>.json`` beside its socket, with the socket's inode so the wrapper
    takes it for this process only. Written whole or not at all (a temporary file renamed);
    never raises."""
    if os.getpid() != pid:
        return  # a forked child exiting through atexit is not the one that served
    try:
        reply = dict(_progress({"since": 0}))
        reply["pid"] = pid
        reply["rank"] = context.RankInfo.from_env().rank  # for a wrapper that never said hello
        reply["inode"] = os.stat(socket_path(directory, pid)).st_ino
        path = last_words_path(directory, pid)
        partial = f"{path}.{os.getpid()}.tmp"
        with open_private(partial, "w", encoding="utf-8") as f:
            json.dump(reply, f)
        os.replace(partial, path)
    except Exception:  # the job is ending: nothing of this may change how
        log.debug("otel-gpu: final progress not left", exc_info=True)


BASE_OPS: dict[str, Handler] = {
    "hello": _hello,
    "progress": _progress,
    "stacks": stacks.handle_stacks,
    "fr.dump": collectives.handle_fr_dump,
}


def serve() -> ControlServer | None:
    """Serve this process's control socket (once); never raises. None when it cannot."""
    global _server
    with _lock:
        if _server is not None:
            return _server
        try:
            directory = runtime_dir()
            path = socket_path(directory, os.getpid())
            _server = ControlServer(path, {**BASE_OPS, **_pending})
        except Exception as exc:  # never harm the job: it runs on without the channel
            log.warning("otel-gpu: control socket not served in this process: %s", exc)
            return None
        if os.environ.get(WATCHED_BY_ENV):
            # registered after the server's own close, so it runs before the socket goes
            atexit.register(_leave_last_words, directory, os.getpid())
        try:
            stacks.install_faulthandler(directory)
        except Exception:  # stacks then come from py-spy or the channel only
            log.debug("otel-gpu: no faulthandler stack dump in this process", exc_info=True)
        return _server


def register(op: str, handler: Handler) -> None:
    """Serve ``op`` from now on (or from :func:`serve` on, when not serving yet)."""
    with _lock:
        _pending[op] = handler
        if _server is not None:
            _server.register(op, handler)


def server() -> ControlServer | None:
    return _server
