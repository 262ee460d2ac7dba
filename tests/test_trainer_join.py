"""The wrapper and the trainer are one job (issue 19.1): ``otel-gpu run`` polls its trainers'
``progress`` over the control channel (otel_gpu/agent/trainers.py) into the detectors, the
view, ``--record`` and the summary, and hands the trainer its runtime directory, its export
settings and (for a plain ``python``) the in-process part.

Real processes: ``otel-gpu run`` around a real training loop (``opentelemetry-instrument
python`` and plain ``python``), real control sockets, an OTLP gRPC receiver on 127.0.0.1.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cli import CLI, clean_env
from support.otlp_sink import OtlpSink

from otel_gpu.agent.settings import Settings
from otel_gpu.agent.trainers import TrainerProgress
from otel_gpu.commands.run import hand_to_trainer, job_title
from otel_gpu.core import runtime_dir as rd
from otel_gpu.core.channel import ChannelError, last_words_path, socket_path
from otel_gpu.sampling.snapshot import ProcessSample, Snapshot
from otel_gpu.tracing.autoload import AUTOLOAD_DIR

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")

# A real CPU torch training loop with a load and a train phase, 24 steps (loss 1/step, so the
# test knows the last one); prints what it was handed.
TRAIN = """
import os, time
import torch
import otel_gpu
print("EXPORTERS", os.environ.get("OTEL_TRACES_EXPORTER"), os.environ.get("OTEL_METRICS_EXPORTER"))
with otel_gpu.phase("load"):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    time.sleep(0.5)
with otel_gpu.phase("train"):
    for i in range(1, 25):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(0.05)
        otel_gpu.step(i, loss=1.0 / i, lr=0.01, samples=64)
print("TRAINED")  # and exits at once: the steps after the last poll come in its last words
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return clean_env(
        OTEL_GPU_RUNTIME_DIR=str(runtime),
        OTEL_GPU_INTERVAL="0.3",
        OTEL_GPU_SIMULATE="steady",
        OTEL_METRIC_EXPORT_INTERVAL="300",
        **extra,
    )


def _run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.run(
        [*CLI, "run", "--view", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env if env is not None else _env(tmp_path),
        cwd=tmp_path,
    )


def _gpu_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["subject"].startswith("gpu:")]


# -- real jobs ---------------------------------------------------------------------------------


@pytest.mark.peers
def test_a_plain_python_job_joins_view_record_and_summary(tmp_path: Path) -> None:
    # No opentelemetry-instrument: run loads the in-process part (sitecustomize), and the
    # user's own sitecustomize still runs.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text(
        "import os\nopen(os.environ['MARK'], 'w').write('ran')\n"
    )
    env = _env(tmp_path, MARK=str(tmp_path / "mark"))
    env["PYTHONPATH"] = os.pathsep.join([str(mine), env.get("PYTHONPATH", "")])
    record, summary = tmp_path / "rec.csv", tmp_path / "summary.json"
    proc = _run(
        tmp_path,
        "--exporter", "none",
        "--record", str(record),
        "--summary-json", str(summary),
        "--", sys.executable, "train.py",
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRAINED" in proc.stdout
    assert (tmp_path / "mark").read_text() == "ran"
    rows = _gpu_rows(record)
    assert {"load", "train"} <= {r["phase"] for r in rows}
    steps = [float(r["step"]) for r in rows if r["step"]]
    assert steps and max(steps) <= 24.0 and steps == sorted(steps)
    training = json.loads(summary.read_text())["training"]
    assert training["steps"] == training["step_ends"] == 24  # none lost at the exit
    assert training["step_rate_per_s"] > 1
    # as the trainer counted them: the 0.5 s load phase too, which a 0.3 s poll may miss
    assert training["phases_s"]["load"] >= 0.5 and training["phases_s"]["train"] >= 1.2
    assert not list((tmp_path / "rt").glob("progress-*"))  # taken and removed
    assert training["last"]["loss"] == pytest.approx(
        1 / 24, abs=1e-6
    )  # the trainer's numbers (19.2)
    assert training["last"]["step_s"] > 0 and training["last"]["samples_per_s"] > 0
    assert " samples/s" in proc.stderr  # the view's title: the trainer's throughput
    assert "phase train  step " in proc.stderr and " loss " in proc.stderr  # the view title
    assert "training: 24 steps" in proc.stderr and "last loss 0.04167" in proc.stderr
    # The report draws the training progress from the recording's step column.
    page = tmp_path / "report.html"
    made = subprocess.run(
        [*CLI, "report", str(record), "-o", str(page)],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert 'id="training-0"' in page.read_text() and "Training progress" in page.read_text()
    # --exporter none reached the trainer: no export attempt, no retry lines in the output.
    assert "EXPORTERS none none" in proc.stdout
    assert "Failed to export" not in proc.stderr and "Transient error" not in proc.stderr


# Trains 12 steps, then its step stops in the train phase (a hang) for a few seconds.
STUCK = """
import os, time
import otel_gpu
with otel_gpu.phase("train"):
    for i in range(1, 13):
        time.sleep(0.1)
        otel_gpu.step(i)
    print("STUCK", os.getpid(), flush=True)
    time.sleep(float(os.environ["STUCK_S"]))
"""


@pytest.mark.peers
def test_on_a_host_without_gpus_the_steps_are_recorded_and_a_stuck_step_is_a_stall(
    tmp_path: Path,
) -> None:
    # No GPU here and none simulated: the steps ride on the trainer's host-memory subject.
    env = _env(
        tmp_path, STUCK_S="8", OTEL_GPU_DETECT="true", OTEL_GPU_DETECT_STALL_STEP_FLOOR_S="2"
    )
    del env["OTEL_GPU_SIMULATE"]
    (tmp_path / "stuck.py").write_text(STUCK)
    record = tmp_path / "rec.csv"
    proc = subprocess.run(
        [*CLI, "run", "--quiet", "--exporter", "none", "--record", str(record), "--",
         INSTRUMENT, sys.executable, "stuck.py"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = int(proc.stdout.split("STUCK ")[1].split()[0])
    with record.open(newline="") as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    assert not [r for r in rows if r["subject"].startswith("gpu:")]
    steps = {r["subject"]: float(r["step"]) for r in rows if r["step"]}
    assert set(steps) == {f"rss:{pid}"} and steps[f"rss:{pid}"] == 12.0
    opened = [ln for ln in proc.stderr.splitlines() if "opened on 1 stall alert" in ln]
    assert len(opened) == 1, proc.stderr[-3000:]  # one alert for the job
    assert f"rss:{pid}" in opened[0] and "training step stuck at 12 for" in opened[0]


@pytest.mark.peers
def test_an_instrumented_trainer_exports_behind_the_wrappers_endpoint(tmp_path: Path) -> None:
    with OtlpSink() as sink:
        summary = tmp_path / "summary.json"
        proc = _run(
            tmp_path,
            "--endpoint", sink.endpoint,
            "--summary-json", str(summary),
            "--", INSTRUMENT, sys.executable, "train.py",
        )  # fmt: skip
        spans = sink.spans()
        points = sink.points()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EXPORTERS otlp otlp" in proc.stdout
    names = {s.name for s in spans}
    assert {"train", "step"} <= names, names  # the trainer's traces reached --endpoint
    assert {p.metric for p in points} >= {"training.step", "hw.gpu.utilization"}
    assert json.loads(summary.read_text())["training"]["steps"] == 24


@pytest.mark.peers
def test_no_instrument_leaves_a_plain_python_job_alone(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = _run(
        tmp_path,
        "--exporter", "none",
        "--no-instrument",
        "--summary-json", str(summary),
        "--", sys.executable, "train.py",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(summary.read_text())["training"] is None
    assert not list((tmp_path / "rt").glob("proc-*.sock"))


# -- the hand-over and the poller, in-process ----------------------------------------------


@pytest.fixture
def fresh_runtime_dir() -> Any:
    """The runtime directory is resolved once a process: an earlier test's is forgotten."""
    rd.reset_for_tests()
    yield
    rd.reset_for_tests()


@pytest.mark.unit
def test_the_wrappers_export_settings_reach_the_trainer_unless_the_user_set_its_own(
    tmp_path: Path, fresh_runtime_dir: None
) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = {"OTEL_GPU_RUNTIME_DIR": str(runtime), "PYTHONPATH": "/a"}
    settings = Settings.load({}, exporter="otlp,console,prometheus", endpoint="http://127.0.0.1:9")
    assert hand_to_trainer(env, settings, {"exporter", "endpoint"}) == str(runtime)
    assert env["OTEL_TRACES_EXPORTER"] == env["OTEL_METRICS_EXPORTER"] == "otlp"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:9"
    assert env["PYTHONPATH"] == os.pathsep.join([AUTOLOAD_DIR, "/a"])
    user = {"OTEL_GPU_RUNTIME_DIR": str(runtime), "OTEL_TRACES_EXPORTER": "console"}
    user["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:7"
    none = Settings.load({}, exporter="none", endpoint="http://127.0.0.1:9", instrument=False)
    hand_to_trainer(user, none, {"exporter", "endpoint", "instrument"})
    assert user["OTEL_TRACES_EXPORTER"] == "console"  # the user's own
    assert user["OTEL_METRICS_EXPORTER"] == user["OTEL_LOGS_EXPORTER"] == "none"
    assert user["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:7"
    assert "PYTHONPATH" not in user


class FakeTrainers:
    """The replies of trainers by PID (``progress`` with a step ring), counting requests."""

    def __init__(self) -> None:
        self.steps: dict[int, list[int]] = {}
        self.gone: set[int] = set()
        self.asked: list[tuple[int, str, int]] = []

    def __call__(self, path: str, op: str, timeout_s: float, **args: Any) -> dict[str, Any]:
        pid = int(Path(path).name.removeprefix("proc-").removesuffix(".sock"))
        self.asked.append((pid, op, args.get("since", -1)))
        if pid in self.gone:
            raise ChannelError("the process that served there is gone")
        if op == "hello":
            return {"pid": pid, "rank": pid % 10}
        ends = [[i + 1, s, 1000.0 + i] for i, s in enumerate(self.steps.get(pid, []))]
        since = args["since"]
        return {
            "phase": "train",
            "step": ends[-1][1] if ends else None,
            "seq": len(ends),
            "steps": [e for e in ends if e[0] > since],
            "lost": 0,
        }


def _snap(t: float, pids: list[int]) -> Snapshot:
    return Snapshot(time=t, processes=tuple(ProcessSample(pid) for pid in pids))


@pytest.mark.unit
def test_the_poller_keeps_a_cursor_is_bounded_and_forgets_the_gone(tmp_path: Path) -> None:
    pids = list(range(100, 112))
    for pid in pids:
        Path(socket_path(str(tmp_path), pid)).write_text("")  # the names are what is listed
    fake = FakeTrainers()
    progress = TrainerProgress(str(tmp_path), max_sockets=4, send=fake)
    fake.steps = {pid: [1, 2, 3] for pid in pids}
    progress.on_snapshot(_snap(1.0, [1, *pids]))  # PID 1 serves no socket: never asked
    asked = {pid for pid, _op, _since in fake.asked}
    assert len(asked) == 4 and 1 not in asked  # at most 4 sockets per sweep
    for t in (2.0, 3.0):
        progress.on_snapshot(_snap(t, pids))
    assert {pid for pid, _op, _since in fake.asked} == set(pids)  # the others in turn
    fake.asked.clear()
    fake.steps[100] = [1, 2, 3, 4, 5]
    for t in (4.0, 5.0, 6.0):
        progress.on_snapshot(_snap(t, pids))
    assert (100, "progress", 3) in fake.asked  # asked since the last step end it saw
    assert progress.step() == 3.0  # the lowest rank's... the slowest trainer's step
    assert progress.phase() == "train"
    assert progress.title() == "phase train  step 3"
    fake.gone.add(101)
    fake.asked.clear()
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):
        progress.on_snapshot(_snap(t, pids))
    assert sum(1 for pid, _op, _since in fake.asked if pid == 101) == 1  # forgotten at once
    # The same PID serves a new socket (it exec'd, as opentelemetry-instrument does): asked again.
    fresh = tmp_path / "fresh"
    fresh.write_text("")
    fresh.rename(socket_path(str(tmp_path), 101))  # a new inode while the old one still exists
    fake.gone.clear()
    fake.asked.clear()
    for t in (13.0, 14.0, 15.0):
        progress.on_snapshot(_snap(t, pids))
    assert (101, "hello", -1) in fake.asked
    summary = progress.summary()
    assert summary is not None and summary["steps"] == 5 and summary["step_ends"] == 5


def _last_words(directory: Path, pid: int, seq: int, steps: list[int], **extra: Any) -> None:
    ends = [[seq - len(steps) + 1 + i, s, 1000.0 + s] for i, s in enumerate(steps)]
    inode = os.stat(socket_path(str(directory), pid)).st_ino
    words = {"phase": None, "step": steps[-1], "seq": seq, "steps": ends, "inode": inode}
    Path(last_words_path(str(directory), pid)).write_text(json.dumps({**words, **extra}))


@pytest.mark.unit
def test_a_trainers_last_words_bring_the_steps_after_the_last_poll(tmp_path: Path) -> None:
    Path(socket_path(str(tmp_path), 200)).write_text("")
    fake = FakeTrainers()
    progress = TrainerProgress(str(tmp_path), send=fake)
    fake.steps = {200: [1, 2, 3]}
    progress.on_snapshot(_snap(1.0, [200]))
    # It ended steps 4..9 and exited before the next poll, leaving the ring (steps 1..9).
    _last_words(tmp_path, 200, 9, list(range(1, 10)), phases_s={"load": 0.4, "train": 3.2})
    fake.gone.add(200)
    progress.on_snapshot(_snap(2.0, []))  # it left the tree
    summary = progress.summary()
    assert summary is not None
    assert (summary["steps"], summary["step_ends"]) == (9, 9)  # no step counted twice
    assert summary["phases_s"] == {"load": 0.4, "train": 3.2}  # the trainer's own count
    assert not Path(last_words_path(str(tmp_path), 200)).exists()  # taken once, removed


@pytest.mark.unit
def test_last_words_of_another_process_under_the_same_pid_are_not_taken(tmp_path: Path) -> None:
    Path(socket_path(str(tmp_path), 201)).write_text("")
    fake = FakeTrainers()
    progress = TrainerProgress(str(tmp_path), send=fake)
    fake.steps = {201: [1, 2]}
    progress.on_snapshot(_snap(1.0, [201]))
    _last_words(tmp_path, 201, 50, list(range(40, 51)), inode=1)  # another socket's inode
    progress.finish()
    summary = progress.summary()
    assert summary is not None and (summary["steps"], summary["step_ends"]) == (2, 2)
    # a ring that lost ends between the cursor and its oldest: counted as lost, not dropped
    _last_words(tmp_path, 201, 50, list(range(40, 51)))
    progress.finish()
    summary = progress.summary()
    assert summary is not None and (summary["steps"], summary["step_ends"]) == (50, 50)


@pytest.mark.unit
def test_the_trainer_counts_its_phases_innermost_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_gpu.tracing import progress

    clock = iter([100.0, 102.0, 103.0, 110.0, 111.0])
    before = progress.phase_seconds()
    monkeypatch.setattr(progress, "_clock", lambda: next(clock))
    train = progress.push_phase("train")  # 100
    save = progress.push_phase("save")  # 102: train had 2 s
    progress.pop_phase(save)  # 103: save had 1 s
    progress.pop_phase(train)  # 110: train had 7 s more
    after = progress.phase_seconds()  # 111: no phase open
    assert after["train"] - before.get("train", 0.0) == pytest.approx(9.0)
    assert after["save"] - before.get("save", 0.0) == pytest.approx(1.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("cmd", "title"),
    [
        (["opentelemetry-instrument", "python", "train.py", "--lr", "1"], "python train.py"),
        (["opentelemetry-instrument", "--traces_exporter", "console", "python3", "a/t.py"],
         "python3 t.py"),
        (["/usr/bin/python3.11", "-m", "torch.distributed.run", "t.py"],
         "python3.11 -m torch.distributed.run"),
        (["torchrun", "--nproc_per_node", "2", "t.py"], "torchrun"),
        (["python", "-c", "print(1)"], "python"),
        (["opentelemetry-instrument"], "opentelemetry-instrument"),
    ],
)  # fmt: skip
def test_the_view_names_the_job_not_its_launcher(cmd: list[str], title: str) -> None:
    assert job_title(cmd) == title


@pytest.mark.unit
def test_last_words_count_for_a_trainer_that_ended_before_its_first_answer(tmp_path: Path) -> None:
    Path(socket_path(str(tmp_path), 300)).write_text("")

    def busy(path: str, op: str, timeout_s: float, **args: Any) -> dict[str, Any]:
        raise ChannelError("no answer within 0.25 s")  # importing torch, on a loaded machine

    progress = TrainerProgress(str(tmp_path), send=busy)
    progress.on_snapshot(_snap(1.0, [300]))
    assert progress.summary() is None  # it never answered
    _last_words(tmp_path, 300, 5, [1, 2, 3, 4, 5], rank=0, phases_s={"train": 1.5})
    progress.on_snapshot(_snap(2.0, []))
    summary = progress.summary()
    assert summary is not None and (summary["steps"], summary["processes"]) == (5, 1)
