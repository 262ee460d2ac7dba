"""An agent running inside the trainer's process gets that trainer handed in where it is built
(:class:`~otel_gpu.agent.watchdog.InProcessTrainer`): its phase and step feed detection, and its
graceful checkpoint-and-stop is asked before any signal is sent."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.agent.watchdog import DetectionSettings, InProcessTrainer
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.sampling.sim import GIB, SimulatedSource

pytestmark = pytest.mark.process

TRAP = (
    "import pathlib, signal, sys, time\n"
    "def h(*_): pathlib.Path(sys.argv[1]).write_text('usr1')\n"
    "signal.signal(signal.SIGUSR1, h)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("trainer_takes_it", "signalled"),
    [(True, False), (False, True)],
    ids=["trainer-takes-the-stop", "trainer-declines-so-the-job-is-signalled"],
)
def test_the_trainer_handed_in_feeds_detection_and_is_asked_to_stop_first(
    tmp_path: Path, trainer_takes_it: bool, signalled: bool
) -> None:
    marker = tmp_path / "job-got-usr1"
    job = subprocess.Popen(
        [sys.executable, "-c", TRAP, str(marker)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        # Detection tuned to find a leak within simulated hours, and the stop action on.
        detection = DetectionSettings(
            detect=DetectConfig(leak_bucket_s=15, leak_min_window_s=900, leak_context_s=1800),
            actions=ActionsConfig(stop_on_alert=True, stop_signal="SIGUSR1"),
        )
        progress_reads: list[str] = []
        asked: queue.Queue[str] = queue.Queue()

        def phase() -> str:
            progress_reads.append("phase")
            return "train"

        def step() -> float:
            progress_reads.append("step")
            return 7.0

        def request_stop(reason: str) -> bool:
            asked.put(reason)
            return trainer_takes_it

        clock = ManualClock()
        agent = Agent(
            Settings(interval_s=1.0, exporter="none"),
            roots=[job.pid],
            source=SimulatedSource("leak", leak_bytes_per_s=12 * GIB / 3600, clock=clock),
            trainer=InProcessTrainer(phase, step, request_stop),
            detection=detection,
        )
        opened = []
        agent.watchdog.transition_listeners.append(opened.append)
        for _ in range(400):  # 30 s of simulated time per sweep
            clock.now += 30.0
            agent.sampler.sample_once()
            if opened:
                break
        assert opened and opened[0].alert is not None and opened[0].alert.kind == "leak"
        assert {"phase", "step"} <= set(progress_reads)  # each sweep read the trainer's progress
        assert asked.get(timeout=10)  # the stop action asked the trainer, with a reason
        deadline = time.monotonic() + (10 if signalled else 0.5)
        while time.monotonic() < deadline and not (
            marker.exists() and marker.read_text() == "usr1"
        ):
            time.sleep(0.05)
        assert marker.exists() is signalled
        agent.shutdown(2.0)
    finally:
        job.kill()
        job.wait()
