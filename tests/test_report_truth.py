"""The report tells what the live run showed, with its context (issue 19 §3).

A recording of a leak that persists to the end is replayed by ``otel-gpu report``: the breaker
transitions are the live watchdog's, the leak is never "resolved" while the floor still rises,
and the page says which command, revision, host and GPU produced it, when, and how it ended.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from support.cli import CLI, clean_env
from support.recording import FAST_LEAK_WINDOWS

from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.detect.breaker import CLOSED, OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.trace import read_rows
from otel_gpu.outputs.record import Recorder, open_recording, read_comments
from otel_gpu.outputs.report.replay import replay_recording
from otel_gpu.outputs.sweeps import on_sweeps
from otel_gpu.sampling.sim import GIB, SimulatedSource


class ManualClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _moves(transitions: list[Transition]) -> list[tuple[str, str, str, float]]:
    return [(t.subject, t.from_state, t.to_state, round(t.time, 6)) for t in transitions]


@pytest.mark.unit
def test_a_persistent_leak_replays_with_the_live_runs_breaker_transitions(tmp_path: Path):
    """Live: the leak opens the breaker and, its floor still rising, holds it open for hours
    past the cooldown. The report's replay of the recording has exactly those transitions
    (before the fix it advanced the breaker without the engine's active conditions and showed
    the leak "cleared" and "resolved" while it went on)."""
    clock = ManualClock()
    source = SimulatedSource("leak", leak_bytes_per_s=12 * GIB / 3600, clock=clock)
    agent = Agent(
        Settings(interval_s=1.0, exporter="none", detect=False),
        roots=[os.getpid()],
        source=source,
    )
    breaker_config = BreakerConfig()
    watchdog = Watchdog(Engine(DetectConfig(**FAST_LEAK_WINDOWS)), Breaker(breaker_config))
    agent.sampler.add_listener(watchdog.on_snapshot)
    live: list[Transition] = []
    watchdog.transition_listeners.append(live.append)
    path = tmp_path / "leak.csv"
    recorder = Recorder(open_recording(str(path)))
    on_sweeps(agent.sampler, watchdog, recorder.on_sweep)
    opened_at = None
    for _ in range(1_000):  # 30 s of data per sweep
        clock.now += 30.0
        agent.sampler.sample_once()
        if opened_at is None and any(t.to_state == OPEN for t in live):
            opened_at = clock.now
        if opened_at is not None and clock.now - opened_at > 6 * breaker_config.cooldown_s:
            break
    recorder.close(timeout_s=10.0)
    agent.shutdown(2.0)
    assert opened_at is not None, "the leak was not found live"
    opened = {t.subject for t in live if t.to_state == OPEN}
    assert not any(t.to_state == CLOSED and t.subject in opened for t in live)  # held open live

    run = replay_recording("leak.csv", read_rows(path), DetectConfig(**FAST_LEAK_WINDOWS))
    assert _moves(run.transitions) == _moves(live)
    assert not any(t.to_state == CLOSED and t.subject in opened for t in run.transitions)


def _git(folder: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
        cwd=folder, check=True, capture_output=True,
    )  # fmt: skip


@pytest.mark.process
def test_the_report_says_which_command_revision_host_and_gpu_and_how_it_ended(tmp_path: Path):
    """A real ``otel-gpu run --record`` in a git checkout with uncommitted changes: the
    recording carries its context, ``analyze`` still reads it, and the report's "Run" table
    shows the (redacted) command, revision and dirty flag, host, GPU model, start date, wall
    duration, exit code and that the GPU was simulated."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "train.py").write_text("import sys, time\ntime.sleep(3)\nsys.exit(7)\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-qm", "first")
    (repo / "train.py").write_text("import sys, time\ntime.sleep(3)\nsys.exit(7)  # edited\n")
    revision = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    recording = tmp_path / "run.csv"
    env = clean_env() | {"OTEL_GPU_SIMULATE_SPEED": "240"}
    res = subprocess.run(
        [*CLI, "run", "--simulate", "leak", "--exporter", "none", "--quiet", "--interval", "0.2",
         "--record", str(recording), "--", "python", "train.py", "--hf_token", "hf_SECRETSECRET"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 7, res.stderr
    context, _ = read_comments(str(recording))
    assert context["revision"] == revision and context["dirty"] is True
    assert context["exit_code"] == 7 and context["simulated"] == "leak"
    assert "hf_SECRETSECRET" not in recording.read_text()

    analyzed = subprocess.run(
        [*CLI, "analyze", str(recording)], env=clean_env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert analyzed.returncode == 0, analyzed.stderr  # the context lines are comments to it

    page = tmp_path / "report.html"
    made = subprocess.run(
        [*CLI, "report", str(recording), "-o", str(page)],
        env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    html = page.read_text(encoding="utf-8")
    table = re.search(r'<table class="context">(.*?)</table>', html, re.S)
    assert table is not None
    cells = dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table.group(1)))
    assert cells["command"].startswith("python train.py --hf_token ")
    assert "SECRET" not in html
    assert cells["revision"].startswith(revision[:12]) and "dirty" in cells["revision"]
    assert cells["host"] == context["host"] and cells["exit code"] == "7"
    assert "Simulated H100" in cells["GPUs"]
    assert cells["started"] == context["started"] and cells["ran"].endswith("s")
    assert "simulate leak" in cells["simulated"]
