"""Every rank's Python stacks, and where the job is stuck (issue 21 §2).

For each process of a job (:mod:`otel_gpu.diagnose.jobprocs`), the Python stack of every
thread, by the first way that works, each bounded:

1. ``py-spy dump --nonblocking --json`` (on ``PATH``) where ptrace is permitted: it never
   pauses the process;
2. the in-process part's ``stacks`` channel operation (:func:`handle_stacks`, served by every
   instrumented process), which needs the process's interpreter to run a thread;
3. the in-process part's ``faulthandler``, registered on ``SIGRTMIN+6`` (SIGUSR1/2 are the stop
   mechanism's and forwarded) and writing to ``<runtime dir>/stacks-<pid>.txt``: it answers
   even when the interpreter is wedged. The signal is sent only to a process whose
   ``/proc/<pid>/status`` says it catches it (an uncaught real-time signal would kill it).

A failure to get a process's stacks is reported with its reasons, never fatal.

Grouping, as ByteRobust does it: processes whose main threads' top frames agree form one group;
the smallest groups (the odd ones out) come first — "rank 1 (PID 4242) in fetch_remote_shard at
data.py:88 · ranks 0, 2 in all_reduce at train.py:120". A group's place is the innermost frame
of the user's own code (not the standard library, not site-packages) and the function it called
there (wrappers such as a decorator's ``wrapper`` skipped). The agent's own frames (the
collective timing's wrappers of ``torch.distributed``) are not the job's and are left out.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.core.channel import ChannelError, request, socket_path
from otel_gpu.diagnose.jobprocs import PROC, JobProcess, runtime_dirs_of

STACK_SIGNAL_OFFSET = 6  # SIGRTMIN + 6: the faulthandler dump
PYSPY_TIMEOUT_S = 5.0
CHANNEL_TIMEOUT_S = 2.0
FAULTHANDLER_TIMEOUT_S = 2.0
MAX_FRAMES = 100  # per thread (faulthandler's own limit)
MAX_THREADS = 100
TOP_FRAMES = 8  # frames of the main thread that must agree for two processes to group
DUMP_PREFIX = "stacks-"

PYSPY = "py-spy"
CHANNEL = "channel"
FAULTHANDLER = "faulthandler"
WAYS = (PYSPY, CHANNEL, FAULTHANDLER)

_WRAPPERS = frozenset(
    ("wrapper", "inner", "_fn", "decorate_context", "wrapped", "_wrapped_call_impl", "_call_impl")
)
_LIBRARY = re.compile(r"/lib/python\d+(\.\d+)?t?/|/site-packages/|/dist-packages/|^<frozen ")
_PACKAGE = "otel_gpu"


def _agent_modules() -> frozenset[str]:
    """The package's own source files, relative to its parent (``otel_gpu/tracing/x.py``): a
    frame in one of them is the agent's, wherever the job's copy is installed."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(package)
    found: set[str] = set()
    for top, _dirs, files in os.walk(package):
        rel = os.path.relpath(top, root)
        found.update(os.path.join(rel, f) for f in files if f.endswith(".py"))
    return frozenset(found)


_AGENT_MODULES = _agent_modules()


def stack_signal() -> int:
    return int(signal.SIGRTMIN) + STACK_SIGNAL_OFFSET


def dump_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{DUMP_PREFIX}{pid}.txt")


# --- the data -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    filename: str
    line: int

    def where(self) -> str:
        return f"{os.path.basename(self.filename) or self.filename}:{self.line}"

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "file": self.filename, "line": self.line}


@dataclass(frozen=True, slots=True)
class ThreadStack:
    name: str
    ident: int
    main: bool
    frames: tuple[Frame, ...]  # innermost first

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ident": self.ident,
            "main": self.main,
            "frames": [f.to_json() for f in self.frames],
        }


@dataclass(slots=True)
class ProcessStacks:
    """One process's stacks, or why there are none (``error``)."""

    pid: int
    rank: int | None = None
    worker: bool = False
    method: str | None = None  # PYSPY, CHANNEL or FAULTHANDLER
    threads: tuple[ThreadStack, ...] = ()
    error: str | None = None
    took_s: float = 0.0

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.main:
                return t
        return self.threads[0] if len(self.threads) == 1 else None

    def label(self) -> str:
        if self.rank is None:
            return f"PID {self.pid}"
        return f"rank {self.rank} worker" if self.worker else f"rank {self.rank}"

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "rank": self.rank,
            "worker": self.worker,
            "method": self.method,
            "error": self.error,
            "took_s": round(self.took_s, 3),
            "threads": [t.to_json() for t in self.threads],
        }


# --- parsers (pure) -------------------------------------------------------------------------


def parse_pyspy(text: str, pid: int) -> tuple[ThreadStack, ...]:
    """``py-spy dump --json`` output: a list of threads, frames innermost first."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy's JSON is not a list of threads")
    threads = []
    for t in data[:MAX_THREADS]:
        if not isinstance(t, dict):
            continue
        frames = tuple(
            Frame(str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
            for f in (t.get("frames") or [])[:MAX_FRAMES]
            if isinstance(f, dict)
        )
        name = str(t.get("thread_name") or "")
        main = t.get("os_thread_id") == pid or name == "MainThread"
        threads.append(ThreadStack(name, int(t.get("thread_id") or 0), main, frames))
    return tuple(threads)


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """A ``faulthandler`` dump of all threads. CPython lists the newest thread first, so the
    last one is the main thread."""
    threads: list[tuple[str, int, list[Frame]]] = []
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            threads.append((m.group(1), int(m.group(2), 16), []))
            continue
        m = _FH_FRAME.match(line)
        if m and threads and len(threads[-1][2]) < MAX_FRAMES:
            lineno = int(m.group(2)) if m.group(2).isdigit() else 0
            threads[-1][2].append(Frame(m.group(3).strip(), m.group(1), lineno))
    out = []
    for i, (_kind, ident, frames) in enumerate(threads[:MAX_THREADS]):
        out.append(ThreadStack("", ident, i == len(threads) - 1, tuple(frames)))
    return tuple(out)


def parse_channel(reply: Mapping[str, Any]) -> tuple[ThreadStack, ...]:
    """The ``stacks`` operation's reply (:func:`handle_stacks`)."""
    threads = []
    for t in list(reply.get("threads") or [])[:MAX_THREADS]:
        frames = tuple(
            Frame(str(f[0]), str(f[1]), int(f[2]))
            for f in list(t.get("frames") or [])[:MAX_FRAMES]
            if isinstance(f, list) and len(f) == 3
        )
        threads.append(
            ThreadStack(str(t.get("name", "")), int(t.get("ident", 0)), bool(t.get("main")), frames)
        )
    return tuple(threads)


# --- the in-process side (the trainer's process) ------------------------------------------


def handle_stacks(_request: Mapping[str, Any]) -> Mapping[str, Any]:
    """The channel operation ``stacks``: every thread's Python stack but the asking one."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    threads = []
    for ident, top in list(sys._current_frames().items())[:MAX_THREADS]:
        if ident == me:
            continue
        frames: list[list[Any]] = []
        f: Any = top
        while f is not None and len(frames) < MAX_FRAMES:
            code = f.f_code
            frames.append([code.co_name, code.co_filename, f.f_lineno or 0])
            f = f.f_back
        threads.append(
            {"name": names.get(ident, ""), "ident": ident, "main": ident == main, "frames": frames}
        )
    return {"pid": os.getpid(), "threads": threads}


_fh_file: Any = None


def install_faulthandler(directory: str) -> str | None:
    """Dump every thread's stack to ``<directory>/stacks-<pid>.txt`` on :func:`stack_signal`;
    the path, or None when the signal is someone else's or faulthandler refuses. Forked
    children (DataLoader workers) drop it: the file is their parent's."""
    global _fh_file
    import faulthandler

    sig = stack_signal()
    if _fh_file is not None:
        return str(_fh_file.name)
    if signal.getsignal(sig) not in (signal.SIG_DFL, None):
        return None  # the job uses this signal itself
    path = dump_path(directory, os.getpid())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        _fh_file = os.fdopen(fd, "a")
        faulthandler.register(sig, file=_fh_file, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        if _fh_file is not None:
            with contextlib.suppress(OSError):
                _fh_file.close()
        _fh_file = None
        return None
    os.register_at_fork(after_in_child=_forget_faulthandler)
    atexit.register(_remove_dump, path, os.getpid())
    return path


def _remove_dump(path: str, owner: int) -> None:
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _forget_faulthandler() -> None:
    global _fh_file
    import faulthandler

    with contextlib.suppress(Exception):
        faulthandler.unregister(stack_signal())
    _fh_file = None  # the parent's file: not closed here (the descriptor is shared)


# --- collection (the watcher's side) ------------------------------------------------------


def catches_signal(pid: int, sig: int, proc: str = PROC) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (``SigCgt`` in its status)."""
    try:
        with open(os.path.join(proc, str(pid), "status")) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _pyspy(exe: str, pid: int, timeout_s: float) -> tuple[ThreadStack, ...]:
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--nonblocking", "--json"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise RuntimeError(exc.strerror or str(exc)) from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "ermission" in ln), lines[0] if lines else "")
        raise RuntimeError(reason[:200] or f"exit {done.returncode}")
    return parse_pyspy(done.stdout, pid)


def _channel(pid: int, environ: Mapping[str, str], timeout_s: float) -> tuple[ThreadStack, ...]:
    reasons = []
    for d in runtime_dirs_of(dict(environ)):
        path = socket_path(d, pid)
        if not os.path.exists(path):
            continue
        try:
            return parse_channel(request(path, "stacks", timeout_s=timeout_s))
        except ChannelError as exc:
            reasons.append(str(exc))
    raise RuntimeError(reasons[0] if reasons else "no in-process part serves it")


def _faulthandler(
    pid: int, environ: Mapping[str, str], timeout_s: float, proc: str
) -> tuple[ThreadStack, ...]:
    sig = stack_signal()
    paths = [dump_path(d, pid) for d in runtime_dirs_of(dict(environ))]
    path = next((p for p in paths if os.path.exists(p)), None)
    if path is None or not catches_signal(pid, sig, proc):
        raise RuntimeError("no in-process faulthandler registered")
    with open(path, "r+b") as f:
        f.truncate(0)  # the process appends: its next dump starts the file
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    size, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = os.path.getsize(path)
        if now != size:
            size, stable_since = now, time.monotonic()
        elif size > 0 and time.monotonic() - stable_since >= 0.1:
            break
    with open(path, errors="replace") as f:
        text = f.read(1 << 22)
    threads = parse_faulthandler(text)
    if not threads:
        raise RuntimeError(f"nothing dumped within {timeout_s:g} s")
    return threads


def find_pyspy(path: str | None = None) -> str | None:
    """py-spy on ``path`` (default: this process's PATH)."""
    return shutil.which("py-spy", path=path)


def collect_one(
    jp: JobProcess,
    *,
    pyspy: str | None,
    proc: str = PROC,
    timeouts: tuple[float, float, float] = (
        PYSPY_TIMEOUT_S,
        CHANNEL_TIMEOUT_S,
        FAULTHANDLER_TIMEOUT_S,
    ),
    only: Sequence[str] = WAYS,
) -> ProcessStacks:
    """The stacks of one process by the first of the ways in ``only`` that works; never
    raises."""
    started = time.monotonic()
    out = ProcessStacks(jp.pid, jp.rank, jp.worker)
    ways: list[tuple[str, Callable[[], tuple[ThreadStack, ...]]]] = []
    if pyspy:
        ways.append((PYSPY, lambda: _pyspy(pyspy, jp.pid, timeouts[0])))
    ways.append((CHANNEL, lambda: _channel(jp.pid, jp.environ, timeouts[1])))
    ways.append((FAULTHANDLER, lambda: _faulthandler(jp.pid, jp.environ, timeouts[2], proc)))
    reasons = [] if pyspy or PYSPY not in only else ["py-spy: not on PATH"]
    for method, way in ways:
        if method not in only:
            continue
        try:
            threads = way()
        except Exception as exc:  # each way's failure is a reason, the next way may work
            reasons.append(f"{method}: {exc}")
            continue
        if threads:
            out.method, out.threads = method, threads
            break
        reasons.append(f"{method}: no threads")
    if out.method is None:
        out.error = "; ".join(reasons)
    out.took_s = time.monotonic() - started
    return out


def collect(
    procs: Sequence[JobProcess],
    *,
    pyspy: str | None = None,
    proc: str = PROC,
    max_parallel: int = 8,
    only: Sequence[str] = WAYS,
) -> list[ProcessStacks]:
    """The stacks of every process, at most ``max_parallel`` at once (each bounded)."""
    if not procs:
        return []
    with ThreadPoolExecutor(max_workers=min(max_parallel, len(procs))) as pool:
        return list(pool.map(lambda jp: collect_one(jp, pyspy=pyspy, proc=proc, only=only), procs))


# --- grouping (pure) ----------------------------------------------------------------------


def is_library(filename: str) -> bool:
    return bool(_LIBRARY.search(filename))


def is_agent(filename: str) -> bool:
    """Is this frame's file one of otel_gpu's own modules (however the job imported it)?"""
    at = filename.rfind(f"/{_PACKAGE}/")
    return at >= 0 and filename[at + 1 :] in _AGENT_MODULES


def job_frames(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """The frames without the agent's own (its wrappers sit between the job and torch)."""
    return tuple(f for f in frames if not is_agent(f.filename))


def _short(function: str) -> str:
    """``_exception_logger.<locals>.wrapper`` (py-spy's qualified names) -> ``wrapper``."""
    return function.rsplit(".", 1)[-1] or function


def locate(frames: Sequence[Frame]) -> tuple[str, str]:
    """(function, file:line): the innermost frame of the user's code and the function it is in
    there — the library function it called (wrappers skipped), else its own."""
    if not frames:
        return "?", "?"
    user = next((i for i, f in enumerate(frames) if not is_library(f.filename)), None)
    if user is None:
        return _short(frames[0].function), frames[0].where()
    called = None
    for j in range(user - 1, -1, -1):
        name = _short(frames[j].function)
        if name not in _WRAPPERS:
            called = name
            break
    return called or _short(frames[user].function), frames[user].where()


@dataclass(slots=True)
class Group:
    """Processes whose main threads' top frames agree."""

    members: list[ProcessStacks]
    function: str
    where: str
    frames: tuple[Frame, ...]
    odd: bool = False  # not the largest group
    extra: dict[str, Any] = field(default_factory=dict)

    def who(self) -> str:
        return who(self.members)

    def line(self) -> str:
        return f"{self.who()} in {self.function} at {self.where}"

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": [m.rank for m in self.members],
            "pids": [m.pid for m in self.members],
            "workers": [m.worker for m in self.members],
            "function": self.function,
            "where": self.where,
            "odd": self.odd,
            "frames": [f.to_json() for f in self.frames],
        }


def _ranges(numbers: Iterable[int]) -> str:
    nums = sorted(set(numbers))
    parts, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(
            str(nums[i])
            if j == i
            else f"{nums[i]}-{nums[j]}"
            if j > i + 1
            else f"{nums[i]}, {nums[j]}"
        )
        i = j + 1
    return ", ".join(parts)


def who(members: Sequence[ProcessStacks]) -> str:
    """ "rank 1 (PID 4242)", "ranks 0, 2", "rank 1 worker (PID 4250)", "PIDs 10, 11"."""
    if len(members) == 1:
        m = members[0]
        return m.label() if m.rank is None else f"{m.label()} (PID {m.pid})"
    ranks = [m.rank for m in members if m.rank is not None]
    workers = all(m.worker for m in members)
    if len(ranks) == len(members):
        noun = "rank workers" if workers else "ranks"
        return f"{noun} {_ranges(ranks)}"
    return f"PIDs {_ranges(m.pid for m in members)}"


def group(stacks: Sequence[ProcessStacks]) -> list[Group]:
    """Groups of processes with stacks, the odd ones out (smallest groups) first; processes
    without stacks are in none (see :func:`failed`)."""
    by_key: dict[tuple[tuple[str, str, int], ...], list[ProcessStacks]] = {}
    frames_of: dict[tuple[tuple[str, str, int], ...], tuple[Frame, ...]] = {}
    for ps in stacks:
        main = ps.main_thread()
        if main is None:
            continue
        frames = job_frames(main.frames)
        key = tuple((f.function, os.path.basename(f.filename), f.line) for f in frames[:TOP_FRAMES])
        by_key.setdefault(key, []).append(ps)
        frames_of.setdefault(key, frames)
    groups = []
    for key, members in by_key.items():
        members.sort(key=lambda m: (m.rank if m.rank is not None else -1, m.worker, m.pid))
        function, where = locate(frames_of[key])
        groups.append(Group(members, function, where, frames_of[key]))
    largest = max((len(g.members) for g in groups), default=0)
    for g in groups:
        g.odd = len(groups) > 1 and len(g.members) < largest
    groups.sort(key=lambda g: (len(g.members), _first_rank(g)))
    return groups


def _first_rank(g: Group) -> tuple[int, int]:
    m = g.members[0]
    return (m.rank if m.rank is not None else -1, m.pid)


def failed(stacks: Sequence[ProcessStacks]) -> list[ProcessStacks]:
    return [ps for ps in stacks if ps.main_thread() is None]


def summary(groups: Sequence[Group]) -> str:
    """One line: every group, the odd ones out first."""
    return " · ".join(g.line() for g in groups)


def describe(groups: Sequence[Group], stacks: Sequence[ProcessStacks]) -> list[str]:
    """Human lines, most telling first: the summary, then one line per failed process."""
    lines = [summary(groups)] if groups else []
    for ps in failed(stacks):
        lines.append(f"{ps.label()} (PID {ps.pid}): no stack ({ps.error or 'no main thread'})")
    return lines
