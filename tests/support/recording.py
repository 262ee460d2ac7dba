"""A real agent on a simulated leaking GPU, recorded with ``--record``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.detect.breaker import Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import Alert, Point
from otel_gpu.outputs.record import Recorder, open_recording
from otel_gpu.outputs.sweeps import on_sweeps
from otel_gpu.sampling.sim import GIB, SimulatedSource

# The demo's short leak windows: a leak is found within minutes of simulated time.
FAST_LEAK_WINDOWS = {"leak_bucket_s": 15, "leak_min_window_s": 900, "leak_context_s": 1800}


def record_simulated_leak(path: Path, seconds: float = 30.0) -> dict:
    """A real agent (sampler thread, engine, breaker) on a simulated leaking GPU at 240x,
    recorded to ``path``; returns what the live run saw."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        source = SimulatedSource("leak", time_scale=240.0, leak_bytes_per_s=12 * GIB / 3600)
        agent = Agent(
            Settings(interval_s=0.1, exporter="none", detect=False),
            roots=[child.pid],
            source=source,
        )
        watchdog = Watchdog(
            Engine(DetectConfig(**FAST_LEAK_WINDOWS)),
            Breaker(BreakerConfig()),
            phase=lambda: source.phase(source.elapsed()),
        )
        agent.sampler.add_listener(watchdog.on_snapshot)
        alerts: list[Alert] = []
        transitions: list[Transition] = []
        judged: list[tuple[str, Point]] = []
        watchdog.alert_listeners.append(alerts.append)
        watchdog.transition_listeners.append(transitions.append)
        recorder = Recorder(open_recording(str(path)))
        on_sweeps(agent.sampler, watchdog, recorder.on_sweep)
        on_sweeps(agent.sampler, watchdog, lambda sweep: judged.extend(sweep.points))
        agent.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not any(a.kind == "leak" for a in alerts):
            time.sleep(0.2)
        time.sleep(1.0)  # a few sweeps after the alert
        agent.shutdown(2.0)
        recorder.close()
    finally:
        child.kill()
        child.wait()
    return {"alerts": alerts, "transitions": transitions, "points": judged}
