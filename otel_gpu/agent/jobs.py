"""What an agent session watches on this node: a command it launches (``otel-gpu run``) or a
process tree that already runs (``otel-gpu watch``). Both follow the
:class:`~otel_gpu.agent.session.Job` protocol; the session calls them in its fixed order."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence

from otel_gpu.agent import job_guard
from otel_gpu.agent.session import AgentInputs
from otel_gpu.core.errors import UsageError

log = logging.getLogger("otel_gpu.run")

# Signals passed on to a launched job. The job runs in its own process group, and a signal goes
# to the whole group, as a terminal's Ctrl-C would: launchers such as `swift` orphan their
# trainer when only they get SIGTERM (docs/background.md §4).
FORWARDED = job_guard.PASSED_ON  # the guard passes the same ones on to the job
# Of those, the ones that ask the job to end: arriving before the launch, the job is not started
# (the SIGUSR ones, a trainer's checkpoint or stop request, wait for it and are passed on).
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

# How often a watched tree's root is looked at (seconds): the session ends this long after it.
ALIVE_POLL_S = 0.5


class LaunchedCommand:
    """A command otel-gpu starts in its own session and process group, forwards
    :data:`FORWARDED` signals to, and reports the exit code of (128+N when signal N ended it,
    as shells report). If the agent fails, the command runs on unwatched."""

    signals: tuple[int, ...] = FORWARDED

    def __init__(self, command: Sequence[str], env: dict[str, str]) -> None:
        """``env``: the job's whole environment."""
        self.command = list(command)
        self.name = os.path.basename(self.command[0])
        self.env = env
        self.child: subprocess.Popen[bytes] | None = None
        self._early: list[int] = []  # signals that arrived before the job existed

    def on_signal(self, signum: int) -> None:
        if self.child is None:
            self._early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signum)

    def find(self) -> bool:
        return True

    def launch(self) -> AgentInputs | None:
        if self._asked_to_end() is not None:
            return None
        try:
            self.child, job_pid = start_guarded(self.command, self.env)
        except OSError as exc:
            raise UsageError(f"cannot start {self.command[0]!r}: {exc.strerror}") from None
        for signum in self._early:
            self.on_signal(signum)
        return AgentInputs(roots=[job_pid], visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def agent_failed(self, exc: Exception) -> None:
        # The job runs on, unwatched, rather than being harmed.
        log.warning("the agent failed to start (%s); %s runs on unwatched", exc, self.command[0])

    def wait(self) -> int:
        if self.child is None:  # asked to end before it started
            return 128 + (self._asked_to_end() or signal.SIGTERM)
        return wait_child(self.child)

    def end(self) -> None:
        return  # the job has ended, or runs on in its own session: never signalled here

    def _asked_to_end(self) -> int | None:
        return next((s for s in self._early if s in ENDING), None)


def start_guarded(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start the job in a session of its own, under its guard (agent/job_guard.py), so that it
    dies with this process however this process dies (SIGKILL included): the guard's process
    (to wait for and to signal as the group) and the job's own PID (to watch and show). This
    process holds the only write end of the guard's pipe for as long as it lives."""

    if not job_guard.available():
        child = subprocess.Popen(cmd, start_new_session=True, env=env)
        return child, child.pid
    read_fd, write_fd = os.pipe()  # non-inheritable: no other child keeps the write end open
    pid_read, pid_write = os.pipe()
    try:
        child = subprocess.Popen(
            job_guard.guarded(cmd, read_fd, pid_write),
            start_new_session=True,
            env=env,
            pass_fds=(read_fd, pid_write),
        )
    except BaseException:
        os.close(write_fd)
        os.close(pid_read)
        raise
    finally:
        os.close(read_fd)
        os.close(pid_write)
    _GUARD_PIPES.append(write_fd)  # closed by the kernel when this process ends, not before
    with os.fdopen(pid_read, "rb") as reply:  # EOF at once if the guard dies first
        text = reply.readline().strip()
    return child, int(text) if text.isdigit() else child.pid


_GUARD_PIPES: list[int] = []


def wait_child(child: subprocess.Popen[bytes]) -> int:
    """Wait for the job; its exit code, or 128+N when signal N ended it (as shells report)."""
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:  # pragma: no cover - handlers replace SIGINT while waiting
            continue
    return 128 - code if code < 0 else code


class RunningTree:
    """A process tree that runs already, watched until its root exits (the same process: its
    start time guards against a reused PID) or SIGINT/SIGTERM. Nothing is sent to it."""

    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, pid: int, start_ticks: int, name: str, *, proc_root: str = "/proc") -> None:
        """``start_ticks``: the root's start time (``/proc/PID/stat`` field 22)."""
        self.pid = pid
        self.name = name
        self.command: list[str] | None = [name]
        self._start_ticks = start_ticks
        self._proc_root = proc_root
        self.stopping = threading.Event()

    def on_signal(self, signum: int) -> None:
        self.stopping.set()

    def find(self) -> bool:
        return not self.stopping.is_set()

    def launch(self) -> AgentInputs | None:
        if self.stopping.is_set():
            return None
        return AgentInputs(roots=[self.pid], visible_devices=self._visible_devices())

    def agent_failed(self, exc: Exception) -> None:
        raise exc  # nothing to watch without the agent

    def wait(self) -> None:
        while not self.stopping.wait(ALIVE_POLL_S):
            if not self.alive():
                break

    def end(self) -> None:
        return

    def alive(self) -> bool:
        """True while the same process runs, not a zombie."""
        from otel_gpu.sampling.procfs import read_stat

        st = read_stat(self._proc_root, self.pid)
        return st is not None and st.starttime == self._start_ticks and st.state not in "ZX"

    def _visible_devices(self) -> str | None:
        """The watched job's CUDA_VISIBLE_DEVICES when readable, else the agent's own."""
        import psutil

        try:
            env = psutil.Process(self.pid).environ()
        except (psutil.Error, OSError):
            env = {}
        return env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
