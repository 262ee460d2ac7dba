"""The agent session's ordering guarantees (otel_gpu/agent/session.py), on real jobs: a bad
setting refuses before anything runs, a failing agent leaves a launched job running with
``/healthz`` saying why, a Ctrl-C before the launch starts no job, and the close is bounded
even when one of its steps never returns.

Sessions run in this process (signal handlers need the main thread); the jobs are real child
processes, the health endpoint a real socket on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource

from otel_gpu.agent.jobs import LaunchedCommand, RunningTree
from otel_gpu.agent.session import AgentInputs, AgentSession, SessionPart
from otel_gpu.agent.settings import Settings
from otel_gpu.core.errors import UsageError
from otel_gpu.outputs.run_outputs import RunOutputs
from otel_gpu.sampling.procfs import read_stat

pytestmark = pytest.mark.process

# A simulated GPU, nothing exported: the session's order, not the export, is under test.
SETTINGS = Settings(exporter="none", simulate="steady", interval_s=0.2, detect=False)


def _resource() -> Resource:
    return Resource.create({"service.name": "session-test"})


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _outputs(tmp_path: Path, **given: Any) -> argparse.Namespace:
    values = {"quiet": True, "view": False, "record": None, "summary_json": None, **given}
    return argparse.Namespace(**values)


@pytest.fixture(autouse=True)
def _signals_restored() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    after = {s: signal.getsignal(s) for s in before}
    for sig, handler in before.items():
        signal.signal(sig, handler)
    assert after == before, "the session left its signal handlers installed"


class FailingAttach(SessionPart):
    """Stands for an agent that cannot start (its instruments fail to register)."""

    name = "failing"

    def attach(self, agent: Any, provider: Any) -> None:
        raise RuntimeError("simulated: NVML unusable")


class HangingStop(SessionPart):
    """A part whose shutdown never returns (a collector that never answers)."""

    name = "hung"

    def __init__(self) -> None:
        self.release = threading.Event()

    def stop(self, timeout_s: float) -> None:
        self.release.wait(60)


def test_a_busy_health_port_is_refused_before_the_recording_and_the_job(
    tmp_path: Path,
) -> None:
    marker, record = tmp_path / "ran", tmp_path / "points.csv"
    job = LaunchedCommand(_python(f"open({str(marker)!r}, 'w')"), dict(os.environ))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        session = AgentSession(
            Settings(exporter="none", health=address),
            job,
            resource=_resource,
            outputs=lambda: RunOutputs(_outputs(tmp_path, record=str(record)), "t"),
        )
        with pytest.raises(UsageError, match=r"--health='127\.0\.0\.1:\d+': cannot listen there"):
            session.run()
    assert job.child is None and not marker.exists()
    assert not record.exists()  # the port is checked before a recording is created


def test_a_bad_detection_setting_refuses_before_outputs_and_job(tmp_path: Path) -> None:
    record = tmp_path / "points.csv"
    job = LaunchedCommand(_python("pass"), dict(os.environ))
    session = AgentSession(
        Settings(exporter="none", detect=True),
        job,
        resource=_resource,
        outputs=lambda: RunOutputs(_outputs(tmp_path, record=str(record)), "t"),
        env={"OTEL_GPU_DETECT_STALL_WINDOW_S": "soon"},
    )
    with pytest.raises(UsageError, match="OTEL_GPU_DETECT_STALL_WINDOW_S"):
        session.run()
    assert job.child is None and not record.exists()


def test_an_agent_that_fails_leaves_the_launched_job_running_and_healthz_says_why() -> None:
    port = _free_port()
    job = LaunchedCommand(_python("import time; time.sleep(2.5); raise SystemExit(7)"), {})
    session = AgentSession(
        Settings(exporter="none", simulate="steady", health=f"127.0.0.1:{port}"),
        job,
        resource=_resource,
        parts=[FailingAttach()],
    )
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def probe() -> None:
        while not done.wait(0.2):
            try:
                code, body = _get(f"http://127.0.0.1:{port}/healthz")
                seen.append((code, body["reason"]))
            except OSError:
                pass

    prober = threading.Thread(target=probe, name="test-probe", daemon=True)
    prober.start()
    try:
        code = session.run()
    finally:
        done.set()
        prober.join(5)
    assert code == 7  # the job ran to its own end, unharmed
    assert (503, "agent not running: simulated: NVML unusable") in seen, seen


def test_a_watched_tree_ends_the_session_when_its_agent_fails_and_the_close_still_runs() -> None:
    port = _free_port()
    tree = subprocess.Popen(["sleep", "30"])
    try:
        st = read_stat("/proc", tree.pid)
        assert st is not None
        session = AgentSession(
            Settings(exporter="none", simulate="steady", health=f"127.0.0.1:{port}"),
            RunningTree(tree.pid, st.starttime, "sleep"),
            resource=_resource,
            parts=[FailingAttach()],
        )
        with pytest.raises(RuntimeError, match="NVML unusable"):
            session.run()
        assert tree.poll() is None  # never signalled
        with socket.socket() as again:  # the health endpoint was closed
            again.bind(("127.0.0.1", port))
    finally:
        tree.kill()
        tree.wait()


def test_the_close_is_bounded_when_one_step_never_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _free_port()
    hung = HangingStop()
    session = AgentSession(
        Settings(
            exporter="none", simulate="steady", health=f"127.0.0.1:{port}", shutdown_timeout_s=1.0
        ),
        LaunchedCommand(["true"], {}),
        resource=_resource,
        parts=[hung],
    )
    caplog.set_level(logging.WARNING, "otel_gpu.export")
    began = time.monotonic()
    try:
        assert session.run() == 0
        took = time.monotonic() - began
    finally:
        hung.release.set()
    assert "shutdown of hung did not finish within 1.0 s" in caplog.text
    # The job and the agent's start take well under a second; the close at most its bound
    # (the hung step would hold it 60 s).
    assert took < 1.0 + 3.0
    with socket.socket() as again:  # the steps after the bounded ones still ran
        again.bind(("127.0.0.1", port))


def _signal_self(signum: int) -> Resource:
    """The export step's resource, built while a signal arrives (after the handlers are
    installed, before the launch): as a Ctrl-C during the resource detectors would."""
    # Installed already (else this signal would end the test run).
    assert signal.getsignal(signum) not in (signal.default_int_handler, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs on the main thread, between two bytecodes
    return _resource()


def test_ctrl_c_before_the_launch_starts_no_job_and_exits_130(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    job = LaunchedCommand(_python(f"open({str(marker)!r}, 'w')"), dict(os.environ))
    session = AgentSession(SETTINGS, job, resource=lambda: _signal_self(signal.SIGINT))
    assert session.run() == 128 + signal.SIGINT
    assert job.child is None and session.agent is None
    time.sleep(0.3)
    assert not marker.exists()


def test_a_signal_that_does_not_end_the_job_reaches_it_once_it_runs() -> None:
    # SIGUSR1 (a trainer's checkpoint request) before the launch is passed on after it: sleep
    # does not handle it, so it ends at once by that signal instead of after 20 s.
    job = LaunchedCommand(["sleep", "20"], {})
    session = AgentSession(SETTINGS, job, resource=lambda: _signal_self(signal.SIGUSR1))
    began = time.monotonic()
    assert session.run() == 128 + signal.SIGUSR1
    assert job.child is not None and time.monotonic() - began < 10


class Recorded(SessionPart):
    """Writes each hook it sees into ``calls``, beside the job's and the outputs'."""

    name = "recorded"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def routes(self) -> dict[str, Any]:
        self.calls.append("part.routes")
        return {"/readyz": lambda: (True, "ready")}

    def prepare(self) -> None:
        self.calls.append("part.prepare")

    def configure(self, inputs: AgentInputs) -> None:
        self.calls.append("part.configure")

    def attach(self, agent: Any, provider: Any) -> None:
        self.calls.append("part.attach")

    def start(self) -> None:
        self.calls.append("part.start")

    def stop(self, timeout_s: float) -> None:
        self.calls.append("part.stop")


class RecordedCommand(LaunchedCommand):
    def __init__(self, calls: list[str], command: list[str]) -> None:
        super().__init__(command, {})
        self.calls = calls

    def find(self) -> bool:
        self.calls.append("job.find")
        return super().find()

    def launch(self) -> AgentInputs | None:
        self.calls.append("job.launch")
        return super().launch()

    def wait(self) -> int:
        self.calls.append("job.wait")
        return super().wait()

    def end(self) -> None:
        self.calls.append("job.end")


class RecordedOutputs(RunOutputs):
    def __init__(self, calls: list[str], args: argparse.Namespace) -> None:
        calls.append("outputs.open")
        super().__init__(args, "t")
        self.calls = calls

    def attach(self, sampler: Any, watchdog: Any, progress: Any = None) -> None:
        self.calls.append("outputs.attach")
        super().attach(sampler, watchdog, progress)

    def start(self, name: str, pid: int, settings: Any, resource: Any = None) -> None:
        self.calls.append("outputs.start")
        super().start(name, pid, settings)

    def finish(self, exit_code: int | None, command: list[str] | None = None) -> None:
        self.calls.append(f"outputs.finish({exit_code})")
        super().finish(exit_code, command)


def test_the_steps_run_in_the_documented_order(tmp_path: Path) -> None:
    calls: list[str] = []

    def resource() -> Resource:
        calls.append("resource")
        return _resource()

    session = AgentSession(
        SETTINGS,
        RecordedCommand(calls, _python("raise SystemExit(3)")),
        resource=resource,
        outputs=lambda: RecordedOutputs(calls, _outputs(tmp_path)),
        parts=[Recorded(calls)],
    )
    assert session.run() == 3
    assert calls == [
        "part.routes",  # bound with /healthz, before the outputs
        "outputs.open",
        "part.prepare",  # the node lock's step: before the job exists
        "job.find",
        "resource",  # the export step: a bad exporter setting refuses before the launch
        "job.launch",
        "part.configure",
        "part.attach",
        "outputs.attach",
        "part.start",  # after the agent started
        "outputs.start",
        "job.wait",
        "part.stop",  # the bounded close
        "job.end",
        "outputs.finish(3)",
    ]
