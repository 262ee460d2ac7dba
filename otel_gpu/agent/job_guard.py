"""The job's guard: the job dies with its wrapper, however the wrapper dies.

``otel-gpu run`` starts the job in a session of its own (so that the signals it forwards reach
the whole process group, as a terminal's would). Nothing then ends the job when the wrapper is
killed with SIGKILL — ``timeout -k``, a CI runner's group kill, the OOM killer: it ran on
unwatched, holding its GPUs. So the wrapper starts the job through this guard::

    otel-gpu run (wrapper) ── pipe (write end, only the wrapper holds it) ──┐
      │                     ◄── pipe: the job's PID, once ──────────────────┤
      └─ guard   python -I -S job_guard.py FD PID_FD GRACE_S -- CMD...   session, group leader
           └─ CMD (the job; exec'd, same group)   PDEATHSIG SIGTERM if the guard itself dies

The wrapper watches, shows and signals the job's own PID (read from the second pipe); the guard
is in none of that: not in the watched tree, never a stop's target.

The guard forks and execs CMD, then waits for one of three things: CMD exits (the guard exits
with the same status, a signal re-raised, so the wrapper reports CMD's code or 128+N); the
pipe ends, which happens only when the wrapper is gone (the guard then sends SIGTERM to the
job's whole group and SIGKILL to what is left after GRACE_S seconds); or a signal from anyone
but the wrapper (``kill <PID>`` of the PID otel-gpu shows), passed on to the job's group as the
wrapper would. Signals the wrapper forwards reach the group directly; the guard ignores them.

The guard runs as a script with ``-I -S`` (no working directory, no site-packages on its path:
nothing another user leaves where the job is launched can run in it) and imports only the
standard library; it holds no GPU memory and is never signalled by a stop. Linux only (pidfds
are not needed: SIGCHLD and SIGIO wake it); elsewhere the job is started directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import sys
import time

GRACE_S = 10.0  # between SIGTERM and SIGKILL to the job's group once the wrapper is gone
# Signals the wrapper forwards to the whole group; from anyone else the guard passes them on.
PASSED_ON = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_PDEATHSIG = 1
_WAKE = (signal.SIGCHLD, signal.SIGIO)


def guarded(command: list[str], read_fd: int, pid_fd: int, grace_s: float = GRACE_S) -> list[str]:
    """The argv that runs ``command`` under the guard, which watches ``read_fd`` (the read end
    of a pipe whose write end only the wrapper holds) and writes the job's PID to ``pid_fd``
    (pass both with ``pass_fds``)."""
    from otel_gpu.core.child_python import python_argv  # here: the guard itself runs as a script

    return python_argv(os.path.abspath(__file__), str(read_fd), str(pid_fd), f"{grace_s:g}", "--",
                       *command, isolated=True)  # fmt: skip


def available() -> bool:
    """Whether the job can be started under the guard here (Linux, a known interpreter)."""
    from otel_gpu.core.child_python import interpreter

    return sys.platform.startswith("linux") and bool(interpreter())


def main(argv: list[str]) -> int:
    read_fd, pid_fd, grace_s = int(argv[1]), int(argv[2]), float(argv[3])
    command = argv[5:]
    wrapper, own = os.getppid(), os.getpid()
    watched = set(PASSED_ON) | set(_WAKE)
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # taken with sigtimedwait, with sender
    os.set_inheritable(read_fd, False)
    os.set_blocking(read_fd, False)
    # SIGIO when the pipe becomes readable or ends: the wrapper's death wakes the guard at once.
    fcntl.fcntl(read_fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(read_fd, fcntl.F_SETFL, fcntl.fcntl(read_fd, fcntl.F_GETFL) | os.O_ASYNC)
    os.set_inheritable(pid_fd, False)
    job = os.fork()
    if job == 0:
        _exec(command, watched)
    with contextlib.suppress(OSError):
        os.write(pid_fd, f"{job}\n".encode())
        os.close(pid_fd)
    while True:
        status = _reaped(job)
        if status is not None:
            return _exit_like(status)
        if _wrapper_gone(read_fd):
            return _end_group(job, grace_s)
        info = signal.sigtimedwait(watched, 1.0)  # the timeout: a missed SIGIO costs 1 s
        sender = None if info is None else info.si_pid
        if info is not None and info.si_signo in PASSED_ON and sender not in (wrapper, own):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgrp(), info.si_signo)  # comes back to us: ignored


def _exec(command: list[str], watched: set[signal.Signals]) -> None:
    """In the forked child: the job, with the signal state a plain start would give it."""
    try:
        for sig in (*PASSED_ON, signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores the last two
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        guard = os.getppid()
        with contextlib.suppress(Exception):  # without prctl the wrapper's death still counts
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != guard:  # the guard died before the signal was armed
            os._exit(128 + int(signal.SIGTERM))
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"otel-gpu: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)
    finally:
        os._exit(127)


def _reaped(job: int) -> int | None:
    with contextlib.suppress(ChildProcessError):
        pid, status = os.waitpid(job, os.WNOHANG)
        if pid == job:
            return status
    return None


def _wrapper_gone(read_fd: int) -> bool:
    try:
        return os.read(read_fd, 1) == b""  # EOF: no writer left
    except BlockingIOError:
        return False  # still open, nothing written


def _exit_like(status: int) -> int:
    """Exit as the job did: its code, or death by the same signal (without a core dump)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL cannot be set (nor blocked)
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal that does not end a process (none of the fatal ones)
    return os.waitstatus_to_exitcode(status)


def _end_group(job: int, grace_s: float) -> int:
    """The wrapper is gone: SIGTERM to the job's group, SIGKILL to what is left of it after
    ``grace_s`` (a trainer saving a checkpoint on SIGTERM gets that long)."""
    group = os.getpgrp()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)  # blocked here: the guard outlives its group
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reaped(job)
        if not _others_in(group):
            return 128 + int(signal.SIGTERM)
        signal.sigtimedwait({signal.SIGCHLD}, 0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)  # the guard too, last: its work is done
    return 128 + int(signal.SIGKILL)


def _others_in(group: int) -> bool:
    """Whether a process other than the guard (and its unreaped job) is in ``group``."""
    own = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rpartition(b")")[2].split()
        except OSError:
            continue  # gone meanwhile
        # After the command's ")": state, ppid, pgrp; a zombie holds nothing.
        if len(fields) > 2 and int(fields[2]) == group and fields[0] != b"Z":
            return True
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv))
