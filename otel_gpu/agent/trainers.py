"""The join of the watcher and the trainers: training progress read over the control channel.

Each sweep (on the sampler's listener thread, before detection; never in an OTel callback nor
on the job's threads) :class:`TrainerProgress` finds the processes of the watched tree that
serve a control socket (``proc-<pid>.sock`` in the runtime directory handed to the job,
docs/inprocess.md), asks each its ``progress`` since the last sequence number it saw, and keeps
the phase and step per process and the step ends. Bounded: at most :data:`MAX_SOCKETS` sockets
per sweep, a short timeout per socket and a budget per sweep; a socket that is gone (or fails
:data:`FORGET_AFTER` times in a row) is forgotten.

What it keeps feeds the detectors (the phase and step an in-process trainer would give,
:meth:`TrainerProgress.as_trainer`), the live view's title, the recording (through the
points) and the summary (:meth:`TrainerProgress.summary`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.core.channel import (
    LAST_WORDS_MAX_BYTES,
    SOCKET_PREFIX,
    ChannelError,
    last_words_path,
    request,
    socket_path,
)
from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.trainers")

MAX_SOCKETS = 8  # trainer sockets asked per sweep; more are asked in turn at later sweeps
TIMEOUT_S = 0.25  # per request
BUDGET_S = 1.0  # all requests of one sweep together
FORGET_AFTER = 3  # failed polls in a row before a process is forgotten
RATE_WINDOW = 64  # step ends kept per process for the step rate

Request = Callable[..., dict[str, Any]]


@dataclass
class TrainerState:
    """What one trainer process told us."""

    pid: int
    inode: int = 0  # of its socket: a new one is a new server (the process exec'd)
    rank: int | None = None
    phase: str | None = None
    step: int | None = None
    seq: int = 0  # the last step-end sequence number seen (the cursor of the next poll)
    step_ends: int = 0  # step ends seen (plus those the trainer's ring lost)
    first_end: tuple[int, float] | None = None  # (step, wall time) of the first end seen
    last_end: tuple[int, float] | None = None
    failures: int = 0
    hello: bool = False
    polled: float = 0.0  # monotonic time of the last poll (oldest first when over the cap)
    recent: list[tuple[int, float]] = field(default_factory=list)  # (step, wall time) ends
    numbers: dict[str, float] = field(default_factory=dict)  # loss, learning_rate, step_s, ...
    phases_s: dict[str, float] | None = None  # seconds per phase, as the trainer counted them

    def step_rate(self) -> float | None:
        """Steps per second over the recent step ends; None before two."""
        if len(self.recent) < 2:
            return None
        (s0, t0), (s1, t1) = self.recent[0], self.recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


class TrainerProgress:
    """Polls the watched tree's trainers each sweep (see the module docstring)."""

    def __init__(
        self,
        directory: str,
        *,
        max_sockets: int = MAX_SOCKETS,
        timeout_s: float = TIMEOUT_S,
        budget_s: float = BUDGET_S,
        send: Request = request,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._max = max_sockets
        self._timeout = timeout_s
        self._budget = budget_s
        self._send = send
        self._clock = clock
        self._lock = threading.Lock()  # the outputs read from other threads
        self._trainers: dict[int, TrainerState] = {}
        # PID -> inode of the socket forgotten (asked again when the socket is made anew)
        self._gone: dict[int, int] = {}
        self._phase_s: dict[str, float] = {}  # seconds spent per phase (the main trainer's)
        self._last_time: float | None = None
        # The trainer with the most step ends so far (kept after it exits, for the summary).
        self._best: TrainerState | None = None
        self._answered = 0  # trainers that ever answered
        self.polls = 0  # requests sent, for tests and benchmarks

    # -- the sampler's listener thread ---------------------------------------------------------

    def on_snapshot(self, snap: Snapshot) -> None:
        """Poll the trainers of ``snap``'s tree; never raises."""
        try:
            self._sweep(snap)
        except Exception:  # never break sampling
            log.debug("trainer poll failed", exc_info=True)

    def _sweep(self, snap: Snapshot) -> None:
        tree = {p.pid for p in snap.processes if p.in_tree}
        sockets = self._sockets()
        # A socket forgotten is asked again once it was made anew (its process exec'd: the
        # same PID, a new server, as under opentelemetry-instrument).
        serving = [
            pid for pid in sorted(tree) if pid in sockets and self._gone.get(pid) != sockets[pid]
        ]
        for pid in [p for p in self._trainers if p not in tree]:
            self._take_last_words(self._trainers[pid])  # the steps after the last poll
        with self._lock:
            for pid in [p for p in self._trainers if p not in tree]:
                del self._trainers[pid]  # exited: its numbers stay in the summary's best
            self._gone = {p: i for p, i in self._gone.items() if p in tree}
            for pid in serving:
                state = self._trainers.get(pid)
                if state is None or state.inode != sockets[pid]:
                    state = self._trainers[pid] = TrainerState(pid, inode=sockets[pid])
            due = sorted(serving, key=lambda p: self._trainers[p].polled)[: self._max]
        deadline = self._clock() + self._budget
        for pid in due:
            left = deadline - self._clock()
            if left <= 0:
                break
            self._poll(self._trainers[pid], min(self._timeout, left))
        self._count_phase(snap.time)

    def _sockets(self) -> dict[int, int]:
        """PID -> inode of each control socket in the directory (one directory read)."""
        found: dict[int, int] = {}
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    name = entry.name
                    if name.startswith(SOCKET_PREFIX) and name.endswith(".sock"):
                        pid = name[len(SOCKET_PREFIX) : -len(".sock")]
                        if pid.isdigit():
                            found[int(pid)] = entry.inode()
        except OSError:
            pass
        return found

    def _poll(self, state: TrainerState, timeout_s: float) -> None:
        path = socket_path(self.directory, state.pid)
        state.polled = self._clock()
        try:
            if not state.hello:
                self.polls += 1
                hello = self._send(path, "hello", timeout_s)
                rank = hello.get("rank")
                state.rank = rank if isinstance(rank, int) else None
                state.hello = True
                with self._lock:
                    self._answered += 1
            self.polls += 1
            reply = self._send(path, "progress", timeout_s, since=state.seq)
        except ChannelError as exc:
            state.failures += 1
            gone = "gone" in str(exc) or "no in-process part" in str(exc)
            if gone or state.failures >= FORGET_AFTER:
                log.debug("trainer %d forgotten: %s", state.pid, exc)
                self._take_last_words(state)
                with self._lock:
                    self._trainers.pop(state.pid, None)
                    self._gone[state.pid] = state.inode
            return
        state.failures = 0
        self._take(state, reply)
        with self._lock:
            best = self._best
            if best is None or best is state or _better(state, best):
                self._best = state

    def finish(self) -> None:
        """When the job has ended: take the final progress its trainers left at exit (the
        steps and phases after the last poll); never raises."""
        with self._lock:
            states = list(self._trainers.values())
        for state in states:
            self._take_last_words(state)

    def _take_last_words(self, state: TrainerState) -> None:
        """Take (and remove) the final progress ``state``'s process left at exit, if it is
        that process's: the same socket inode (also when it ended before its first poll)."""
        path = last_words_path(self.directory, state.pid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return  # none left (killed, or not under otel-gpu run)
        try:
            with os.fdopen(fd, "rb") as f:
                raw = f.read(LAST_WORDS_MAX_BYTES + 1)
            os.unlink(path)
            reply = json.loads(raw) if len(raw) <= LAST_WORDS_MAX_BYTES else None
        except (OSError, ValueError) as exc:
            log.debug("trainer %d: final progress unreadable: %s", state.pid, exc)
            return
        if not isinstance(reply, dict) or reply.get("inode") != state.inode:
            return  # another process's under a reused PID
        # It holds every step end the ring kept: those after our cursor are new, and any gap
        # before the first of them was lost.
        ends = [e for e in reply.get("steps") or [] if _after(e, state.seq)]
        seq = reply.get("seq")
        newest = seq if isinstance(seq, int) else state.seq
        reply["lost"] = max(0, (ends[0][0] if ends else newest + 1) - state.seq - 1)
        if not state.hello:
            rank = reply.get("rank")
            state.rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
            state.hello = True
            with self._lock:
                self._answered += 1
        self._take(state, reply)
        with self._lock:
            best = self._best
            if best is None or best is state or _better(state, best):
                self._best = state

    @staticmethod
    def _take(state: TrainerState, reply: Mapping[str, Any]) -> None:
        phase, step = reply.get("phase"), reply.get("step")
        state.phase = phase if isinstance(phase, str) else None
        state.step = step if isinstance(step, int) and not isinstance(step, bool) else None
        numbers, phases = _numbers(reply.get("numbers")), _numbers(reply.get("phases_s"))
        if numbers is not None:
            state.numbers = numbers
        if phases is not None:
            state.phases_s = phases
        seq = reply.get("seq")
        ends = [e for e in reply.get("steps") or [] if _after(e, state.seq)]
        lost = reply.get("lost")
        state.step_ends += len(ends) + (lost if isinstance(lost, int) and lost > 0 else 0)
        for end in ends:
            if not (isinstance(end, list) and len(end) == 3):
                continue
            _seq, end_step, wall = end
            pair = (int(end_step), float(wall))
            if state.first_end is None:
                state.first_end = pair
            state.last_end = pair
            state.recent.append(pair)
        del state.recent[:-RATE_WINDOW]
        if isinstance(seq, int):
            state.seq = seq

    def _count_phase(self, now: float) -> None:
        last, self._last_time = self._last_time, now
        phase = self.phase()
        if last is not None and phase is not None and now > last:
            with self._lock:
                self._phase_s[phase] = self._phase_s.get(phase, 0.0) + (now - last)

    # -- readers ------------------------------------------------------------------------------

    def _main(self) -> TrainerState | None:
        """The trainer that speaks for the job: rank 0, else the lowest PID that reported."""
        with self._lock:
            known = [t for t in self._trainers.values() if t.hello]
        if not known:
            return None
        return min(known, key=lambda t: (t.rank if t.rank is not None else 1 << 30, t.pid))

    def main_pid(self) -> int | None:
        """The PID of the trainer that speaks for the job (None before one answered)."""
        main = self._main()
        return main.pid if main is not None else None

    def phase(self) -> str | None:
        """The job's phase now: its main trainer's."""
        main = self._main()
        return main.phase if main is not None else None

    def step(self) -> float | None:
        """The job's step now: the lowest of its trainers' (a rank that stops, stops the job)."""
        with self._lock:
            steps = [t.step for t in self._trainers.values() if t.step is not None]
        return float(min(steps)) if steps else None

    def numbers(self) -> dict[str, float]:
        """The main trainer's last training numbers (``loss``, ``learning_rate``, ...)."""
        main = self._main()
        return dict(main.numbers) if main is not None else {}

    def title(self) -> str | None:
        """For the live view's title line: ``phase train  step 1234  loss 0.412``; None
        before any."""
        phase, step, numbers = self.phase(), self.step(), self.numbers()
        parts = []
        if phase:
            parts.append(f"phase {phase}")
        if step is not None:
            parts.append(f"step {int(step)}")
        if "loss" in numbers:
            parts.append(f"loss {numbers['loss']:.4g}")
        if "samples_per_s" in numbers:
            parts.append(f"{numbers['samples_per_s']:.3g} samples/s")
        elif "tokens_per_s" in numbers:
            parts.append(f"{numbers['tokens_per_s']:.3g} tokens/s")
        return "  ".join(parts) or None

    def as_trainer(self) -> Any:
        """The detectors' phase and step source (what an in-process trainer gives them)."""
        from otel_gpu.agent.watchdog import InProcessTrainer

        return InProcessTrainer(phase=self.phase, step=self.step, pid=self.main_pid)

    def summary(self) -> dict[str, Any] | None:
        """The training part of the end-of-run summary; None when no trainer ever answered."""
        with self._lock:
            trainers = len(self._trainers)
            phases = {k: round(v, 1) for k, v in self._phase_s.items()}
            best = self._best
        if best is None and not phases:
            return None
        if best is not None and best.phases_s is not None:
            phases = {k: round(v, 1) for k, v in best.phases_s.items() if v >= 0.05}
        out: dict[str, Any] = {"phases_s": phases}
        if best is not None:
            out["steps"] = best.step
            out["step_ends"] = best.step_ends
            rate = _overall_rate(best)
            out["step_rate_per_s"] = None if rate is None else round(rate, 3)
            out["processes"] = max(trainers, self._answered)
            out["last"] = {k: round(v, 6) for k, v in best.numbers.items()}
        return out


def _numbers(found: Any) -> dict[str, float] | None:
    """A reply's ``{name: number}`` (anything else in it passed over); None when not a dict."""
    if not isinstance(found, dict):
        return None
    return {
        k: float(v)
        for k, v in found.items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _after(end: Any, seq: int) -> bool:
    """A step end ``[seq, step, wall]`` after the cursor ``seq`` (final progress holds them
    all; a trainer's reply, only those after the cursor asked with)."""
    return isinstance(end, list) and len(end) == 3 and isinstance(end[0], int) and end[0] > seq


def _better(a: TrainerState, b: TrainerState) -> bool:
    """Whether ``a`` speaks for the job's steps rather than ``b``: more step ends, then rank 0."""
    rank_a = a.rank if a.rank is not None else 1 << 30
    rank_b = b.rank if b.rank is not None else 1 << 30
    return (a.step_ends, -rank_a) > (b.step_ends, -rank_b)


def _overall_rate(state: TrainerState) -> float | None:
    if state.first_end is None or state.last_end is None:
        return None
    (s0, t0), (s1, t1) = state.first_end, state.last_end
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None
