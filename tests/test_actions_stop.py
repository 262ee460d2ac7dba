"""Stop action with real child processes: only the allowed trainer PIDs ever get the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_gpu.actions import ActionDispatcher, ActionsConfig, JobStopper, parse_signal
from otel_gpu.core.errors import UsageError
from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.model import LEAK, THRESHOLD, Alert

# A trainer stand-in: traps SIGUSR1 and SIGTERM, appends the signal name to a file per delivery.
CHILD = r"""
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def handler(sig, frame):
    with out.open("a") as f:
        f.write(signal.Signals(sig).name + "\n")
signal.signal(signal.SIGUSR1, handler)
signal.signal(signal.SIGTERM, handler)
pathlib.Path(sys.argv[2]).write_text("ready")
end = time.monotonic() + 60
while time.monotonic() < end:
    time.sleep(0.02)
"""


class Child:
    def __init__(self, tmp: Path, name: str) -> None:
        self.out = tmp / f"{name}.signals"
        ready = tmp / f"{name}.ready"
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(self.out), str(ready)])
        self.pid = self.proc.pid
        end = time.monotonic() + 10
        while not ready.exists():
            assert time.monotonic() < end, "child did not start"
            time.sleep(0.01)

    def received(self, wait_s: float = 0.0) -> list[str]:
        end = time.monotonic() + wait_s
        while True:
            got = self.out.read_text().split() if self.out.exists() else []
            if got or time.monotonic() >= end:
                return got
            time.sleep(0.01)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[Child]]:
    made: list[Child] = []

    def make(name: str) -> Child:
        c = Child(tmp_path, name)
        made.append(c)
        return c

    yield make  # type: ignore[misc]
    for c in made:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait(5)


@pytest.mark.process
def test_signals_the_allowed_trainer_and_nothing_else(children) -> None:  # type: ignore[no-untyped-def]
    trainer, sibling = children("trainer"), children("sibling")
    stopper = JobStopper(lambda: {trainer.pid})
    result = stopper.stop("leak on gpu0")
    assert result.signalled == (trainer.pid,) and not result.requested
    assert trainer.received(wait_s=5) == ["SIGUSR1"]
    time.sleep(0.1)
    assert sibling.received() == [] and sibling.proc.poll() is None


@pytest.mark.process
def test_refuses_unsafe_and_vanished_pids(children) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(10)  # reaped: its PID no longer names a process of ours
    bystander = children("bystander")
    unsafe = {0, 1, -1, -bystander.pid, os.getpid(), done.pid}
    result = JobStopper(lambda: unsafe).stop("test")
    # Reaching this line at all shows our own PID was not sent SIGUSR1 (default action: die).
    assert result.signalled == ()
    assert set(result.refused) == unsafe
    time.sleep(0.1)
    assert bystander.received() == []


@pytest.mark.process
def test_pid_dropped_from_the_allowed_set_before_sending_is_spared(children) -> None:  # type: ignore[no-untyped-def]
    a, b = children("a"), children("b")
    calls = iter([{a.pid, b.pid}, {a.pid}])  # b left the job between listing and sending
    result = JobStopper(lambda: next(calls)).stop("test")
    assert result.signalled == (a.pid,) and result.refused == (b.pid,)
    assert a.received(wait_s=5) == ["SIGUSR1"]
    time.sleep(0.1)
    assert b.received() == []


@pytest.mark.process
def test_in_process_request_comes_first(children) -> None:  # type: ignore[no-untyped-def]
    trainer = children("trainer")
    reasons: list[str] = []

    def take(reason: str) -> bool:
        reasons.append(reason)
        return True

    result = JobStopper(lambda: {trainer.pid}, request_fn=take).stop("leak on gpu0")
    assert result.requested and reasons == ["leak on gpu0"]
    time.sleep(0.1)
    assert trainer.received() == []

    def broken(reason: str) -> bool:
        raise RuntimeError("no trainer yet")

    for n, fn in enumerate((lambda r: False, broken), 1):  # declined or failed: signal instead
        result = JobStopper(lambda: {trainer.pid}, signal="TERM", request_fn=fn).stop("x")
        assert result.signalled == (trainer.pid,)
        # Wait for each delivery: two pending SIGTERMs would coalesce into one.
        deadline = time.monotonic() + 5
        while len(trainer.received()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
    assert trainer.received() == ["SIGTERM", "SIGTERM"]


@pytest.mark.unit
def test_signal_names() -> None:
    assert parse_signal("SIGTERM") is signal.SIGTERM
    assert parse_signal("usr2") is signal.SIGUSR2
    assert parse_signal(int(signal.SIGINT)) is signal.SIGINT
    for bad in ("SIGKILL", "SIGSTOP", "BOGUS", "9"):
        with pytest.raises(UsageError) as e:
            parse_signal(bad)
        assert "SIGUSR1" in str(e.value)  # names the accepted values


def _opened(kind: str, episode: int, subject: str = "job") -> Transition:
    a = Alert(kind, subject, 10.0, "critical", f"{kind} found")
    return Transition(subject, "closed", "open", 10.0, "opened", a, episode)


@pytest.mark.process
def test_dispatcher_stops_once_per_episode_and_only_for_chosen_kinds(children) -> None:  # type: ignore[no-untyped-def]
    trainer = children("trainer")
    off = ActionDispatcher.from_config(ActionsConfig(), allowed_pids=lambda: {trainer.pid})
    off.on_transition(_opened(LEAK, 1))  # stop is opt-in: default config never signals
    cfg = ActionsConfig.from_env(
        {
            "OTEL_GPU_STOP_ON_ALERT": "true",
            "OTEL_GPU_STOP_KINDS": "leak",
            "OTEL_GPU_STOP_SIGNAL": "SIGTERM",
        }
    )
    d = ActionDispatcher.from_config(cfg, allowed_pids=lambda: {trainer.pid})
    d.on_transition(_opened(THRESHOLD, 1))  # not a stop kind
    time.sleep(0.1)
    assert trainer.received() == [] and d.stats.stops == 0
    d.on_transition(_opened(LEAK, 2))
    reopen = _opened(LEAK, 2)
    d.on_transition(Transition("job", "half_open", "open", 20.0, "re-opened", reopen.alert, 2))
    assert trainer.received(wait_s=5) == ["SIGTERM"]
    time.sleep(0.1)
    assert trainer.received() == ["SIGTERM"] and d.stats.stops == 1  # once for episode 2
    d.on_transition(_opened(LEAK, 3))
    deadline = time.monotonic() + 5
    while len(trainer.received()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trainer.received() == ["SIGTERM", "SIGTERM"]
    # A ready-made stopper takes the configured signal.
    given = JobStopper(lambda: {trainer.pid})
    ActionDispatcher.from_config(cfg, stopper=given)
    assert given.signal is signal.SIGTERM
    off.close(1)
    d.close(1)
