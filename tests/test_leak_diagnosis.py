"""A leak alert about a trainer process carries the holders its census names (issue 20 §4):
the agent's diagnoser asks the real trainer over its channel, a suspicion asks for the
baseline first, and the notifier's text shows the top three holders."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.leak_trainer import LEAK_HOLDERS, running_trainer

from otel_gpu.actions.notifiers import format_text
from otel_gpu.agent.memory_diagnosis import MemoryAttribution, subject_pid
from otel_gpu.detect.breaker import CLOSED, OPEN, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import LEAK, Alert, Point

pytestmark = pytest.mark.peers  # a torch trainer for seconds

BYTES_SHOWN = 3


@pytest.fixture(scope="module")
def runtime_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="otel-gpu-test-"))
    run = base / "run"
    run.mkdir(mode=0o700)
    yield run
    shutil.rmtree(base, ignore_errors=True)


def _suspect(engine: Engine, subject: str) -> float:
    """Feed a steadily rising floor until the engine suspects a leak (minutes of data time)."""
    t, used = 0.0, 20e9
    while engine.suspected(subject) is None:
        t += 60.0
        used += 20e6 if t > 3600 else 0.0
        assert not engine.observe(subject, Point(t, used_bytes=used, limit_bytes=80e9, procs=1))
        assert t < 3 * 3600
    return t


def test_a_leak_alert_on_a_trainer_names_the_growing_holders(
    runtime_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    attribution = MemoryAttribution(over_s=1.0)
    with running_trainer("leaks", runtime_dir, OTEL_GPU_RUNTIME_DIR=str(runtime_dir)) as proc:
        subject = f"rss:{proc.pid}"
        assert subject_pid(subject) == proc.pid
        engine = Engine()
        t = _suspect(engine, subject)
        with caplog.at_level(logging.INFO, "otel_gpu.agent"):
            attribution.on_sweep(engine, [(subject, Point(t))])  # the baseline, in the back
            attribution.on_sweep(engine, [(subject, Point(t))])  # once per suspicion
        said = [r.getMessage() for r in caplog.records if "leak suspected" in r.getMessage()]
        assert said == [
            f"leak suspected on {subject} since t={engine.suspected(subject):g} s: "
            "attribution started"
        ]
        time.sleep(3.0)  # the leak goes on between suspicion and alert
        alert = Alert(LEAK, subject, t + 60, "warning", "memory leak suspected: floor rising")
        queue = attribution.queue(timeout_s=60.0)
        queue.submit(alert, [])
        released: list[tuple[Alert, list[Transition]]] = []
        deadline = time.monotonic() + 60
        while not released and time.monotonic() < deadline:
            time.sleep(0.2)
            released = queue.release()
    [(diagnosed, _)] = released
    found = diagnosed.diagnosis
    assert found is not None and found.kind == "memory" and found.error is None, found
    assert set(found.data["growing"]) == set(LEAK_HOLDERS.values())
    # growth since the suspicion's baseline: seconds of steps, not the last 1 s only
    assert found.data["over_s"] >= 3.0
    assert len(found.lines) == len(LEAK_HOLDERS)
    first = found.data["holders"][0]
    assert found.lines[0].startswith(f"{first['path']}: +{first['growth_count']} tensors, +")
    t_open = Transition(subject, CLOSED, OPEN, alert.time, "leak", diagnosed, 1)
    title, body = format_text(t_open)
    assert title == f"otel-gpu ALERT: leak (warning) on {subject}"
    shown = [line for line in body.splitlines() if " tensors, +" in line]
    assert shown == list(found.lines[:BYTES_SHOWN])
    print(f"{title}\n{body}")  # docs/diagnosis.md's example alert comes from here


def test_no_in_process_part_and_a_whole_gpu_say_why() -> None:
    attribution = MemoryAttribution(over_s=0.0)
    gpu = attribution.diagnose(Alert(LEAK, "gpu:GPU-1", 0.0, "warning", "leak"))
    assert gpu is not None and gpu.error == "the subject is not one process"
    assert not attribution.queue().takes(Alert(LEAK, "gpu:GPU-1", 0.0, "warning", "leak"))
    lone = attribution.diagnose(Alert(LEAK, "rss:999999999", 0.0, "warning", "leak"))
    assert lone is not None and lone.lines == ()
    assert lone.error == "pid 999999999 answered no census: no in-process part serves there"
    assert lone.shown() == [f"no diagnosis: {lone.error}"]
