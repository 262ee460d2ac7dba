"""Detection inside the agent: a real child process on a simulated leaking GPU, the engine, the
breaker, the detector instruments and the opt-in stop that only ever signals the job."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.points import snapshot_points
from otel_gpu.agent.settings import Settings
from otel_gpu.agent.watchdog import DetectionSettings, Watchdog
from otel_gpu.detect.breaker import Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.sampling.sim import GIB, SimulatedSource
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

TRAP = (
    "import pathlib, signal, sys, time\n"
    "def h(*_): pathlib.Path(sys.argv[1]).write_text('usr1')\n"
    "signal.signal(signal.SIGUSR1, h)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture()
def trapping_child(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    marker = tmp_path / "job-got-usr1"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAP, str(marker)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc, marker
    proc.kill()
    proc.wait()


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.process
def test_leak_opens_the_breaker_exports_detector_metrics_and_stops_only_the_job(
    trapping_child: tuple[subprocess.Popen, Path],
    tmp_path: Path,
) -> None:
    job, marker = trapping_child
    bystander_marker = tmp_path / "bystander-got-usr1"
    bystander = subprocess.Popen(
        [sys.executable, "-c", TRAP, str(bystander_marker)], stdout=subprocess.PIPE, text=True
    )
    assert bystander.stdout is not None and bystander.stdout.readline().strip() == "ready"
    # Detection tuned to find a leak within simulated hours, and the stop action on.
    detection = DetectionSettings(
        detect=DetectConfig(leak_bucket_s=15, leak_min_window_s=900, leak_context_s=1800),
        actions=ActionsConfig(stop_on_alert=True, stop_signal="SIGUSR1"),
    )
    clock = ManualClock()
    source = SimulatedSource("leak", leak_bytes_per_s=12 * GIB / 3600, clock=clock)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        agent = Agent(
            Settings(interval_s=1.0, exporter="none"),
            meter_provider=provider,
            roots=[job.pid],
            source=source,
            detection=detection,
        )
        assert isinstance(agent.watchdog, Watchdog)
        opened = []
        agent.watchdog.transition_listeners.append(opened.append)
        for _ in range(400):  # 30 s of simulated time per sweep, up to 3 h 20 min
            clock.now += 30.0
            agent.sampler.sample_once()
            if opened:
                break
        assert opened, "the leak was not found"
        t = opened[0]
        assert t.to_state == "open" and t.alert is not None and t.alert.kind == "leak"
        assert t.alert.rate_bytes_per_s == pytest.approx(12 * GIB / 3600, rel=0.35)
        assert agent.watchdog.trainer_pids == {job.pid}
        deadline = time.monotonic() + 10
        # the handler creates the file, then writes it: wait for the content
        while time.monotonic() < deadline and not (
            marker.exists() and marker.read_text() == "usr1"
        ):
            time.sleep(0.05)
        assert marker.read_text() == "usr1"  # the job was asked to checkpoint and stop
        assert not bystander_marker.exists()  # nothing outside the job is ever signalled

        data = reader.get_metrics_data()
        assert data is not None
        names = {
            m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        }
        rates = names["otel_gpu.leak.rate"].data.data_points
        assert any(p.attributes.get("otel_gpu.subject") == t.subject and p.value > 0 for p in rates)
        states = {
            p.attributes["otel_gpu.subject"]: p.value
            for p in names["otel_gpu.breaker.state"].data.data_points
        }
        assert states[t.subject] == 2  # open
        assert any(p.value >= 1 for p in names["otel_gpu.alerts"].data.data_points)
        assert names["otel_gpu.memory.time_to_exhaustion"].data.data_points
        agent.shutdown(2.0)
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.process
def test_steady_job_raises_nothing_over_hours() -> None:
    clock = ManualClock()
    source = SimulatedSource("steady", clock=clock)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent = Agent(Settings(interval_s=1.0, exporter="none"), roots=[child.pid], source=source)
        alerts = []
        agent.watchdog.alert_listeners.append(alerts.append)
        for _ in range(6 * 60):  # six hours at 60 s per sweep
            clock.now += 60.0
            agent.sampler.sample_once()
        assert alerts == []
    finally:
        child.kill()
        child.wait()


@pytest.mark.unit
def test_only_watched_processes_feed_host_memory_subjects() -> None:
    snap = Snapshot(
        time=10.0,
        processes=(
            ProcessSample(pid=1, memory_rss=100, in_tree=True),
            ProcessSample(pid=2, memory_rss=200, in_tree=False),
        ),
    )
    subjects = [s for s, _p, _a in snapshot_points(snap, host_memory=1000)]
    assert subjects == ["rss:1"]


@pytest.mark.unit
def test_without_a_gpu_the_steps_ride_on_the_main_trainers_host_memory() -> None:
    procs = (
        ProcessSample(pid=1, memory_rss=100, in_tree=True),  # the launcher
        ProcessSample(pid=2, memory_rss=200, in_tree=True),  # the main trainer
        ProcessSample(pid=3, memory_rss=300, in_tree=True),  # another rank
    )
    bare = Snapshot(time=10.0, processes=procs)
    steps = {s: p.step for s, p, _a in snapshot_points(bare, "train", 42.0, 1000, step_pid=2)}
    assert steps == {"rss:1": None, "rss:2": 42.0, "rss:3": None}  # once for the job
    # With a GPU in the sweep the steps stay on the GPU's point, as before.
    gpu = GpuSample(uuid="G", index=0, memory_used=5, processes_listed=True)
    with_gpu = Snapshot(time=10.0, gpus=(gpu,), processes=procs)
    steps = {s: p.step for s, p, _a in snapshot_points(with_gpu, "train", 42.0, 1000, step_pid=2)}
    assert steps == {"gpu:G": 42.0, "rss:1": None, "rss:2": None, "rss:3": None}


@pytest.mark.unit
def test_unlisted_gpu_processes_are_unknown_not_zero() -> None:
    """NVML could not list processes (MIG, vGPU, a timeout): the count is unknown, not 0, so
    the detectors don't read it as "memory released" and drop their evidence."""
    listed = GpuSample(uuid="G", index=0, memory_used=5, processes_listed=True)
    unlisted = GpuSample(uuid="H", index=1, memory_used=5, processes_listed=False)
    snap = Snapshot(time=1.0, gpus=(listed, unlisted))
    procs = {s: p.procs for s, p, _a in snapshot_points(snap)}
    assert procs == {"gpu:G": 0, "gpu:H": None}


@pytest.mark.unit
def test_stop_targets_are_watched_processes_on_a_gpu_only() -> None:
    """A launcher in the tree without GPU memory and a GPU process outside the tree are never
    stop targets; the trainer (in the tree, on a GPU) is, until it leaves the GPU."""
    from otel_gpu.detect.breaker import Breaker
    from otel_gpu.detect.engine import Engine

    wd = Watchdog(Engine(), Breaker())
    snap = Snapshot(
        time=1.0,
        gpus=(GpuSample(uuid="G", index=0, processes_listed=True),),
        gpu_processes=(
            GpuProcessSample(pid=20, gpu_uuid="G", used_memory=1),
            GpuProcessSample(pid=99, gpu_uuid="G", used_memory=1),
        ),
        processes=(
            ProcessSample(pid=10, in_tree=True),  # launcher
            ProcessSample(pid=20, in_tree=True),  # trainer
            ProcessSample(pid=99, in_tree=False),  # another job on the same GPU
        ),
    )
    wd.on_snapshot(snap)
    assert wd.trainer_pids == {20}
    wd.on_snapshot(Snapshot(time=2.0, processes=snap.processes))
    assert wd.trainer_pids == set()


def _trainer_sweep(wd: Watchdog, pid: int, start_ticks: int | None) -> None:
    wd.on_snapshot(
        Snapshot(
            time=1.0,
            gpus=(GpuSample(uuid="G", index=0, processes_listed=True),),
            gpu_processes=(GpuProcessSample(pid=pid, gpu_uuid="G", used_memory=1),),
            processes=(ProcessSample(pid=pid, start_ticks=start_ticks),),
        )
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("seen", "now", "verified"),
    [
        (5000, 5000, True),  # the same process
        (5000, 5001, False),  # PID reused one tick (10 ms) later: a 1 s tolerance missed it
        (5000, 4999, False),
        (5000, None, False),  # gone
        (None, 5000, False),  # start unknown at the sweep: never signalled
    ],
)
def test_a_stop_target_must_have_the_exact_start_tick_the_sweep_saw(
    seen: int | None, now: int | None, verified: bool
) -> None:
    from otel_gpu.detect.breaker import Breaker
    from otel_gpu.detect.engine import Engine

    wd = Watchdog(Engine(), Breaker(), start_ticks=lambda pid: now)
    _trainer_sweep(wd, 4242, seen)
    assert wd.trainer_pids == {4242}
    assert wd.verified_trainers() == ({4242} if verified else set())


@pytest.mark.process
def test_a_reused_pid_is_never_a_stop_target() -> None:
    """The real reader on a real child: the start tick the process tree saw verifies it; one
    tick off (another process under the same PID, started within the same second) does not."""
    from otel_gpu.actions.stop import start_ticks
    from otel_gpu.detect.breaker import Breaker
    from otel_gpu.detect.engine import Engine
    from otel_gpu.sampling.procs import ProcessTree

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        seen = {p.pid: p.start_ticks for p in ProcessTree([child.pid]).sample().processes}
        ticks = seen[child.pid]
        assert ticks is not None and start_ticks(child.pid) == ticks
        wd = Watchdog(Engine(), Breaker())
        _trainer_sweep(wd, child.pid, ticks)
        assert wd.verified_trainers() == {child.pid}
        _trainer_sweep(wd, child.pid, ticks - 1)
        assert wd.trainer_pids == {child.pid} and wd.verified_trainers() == set()
    finally:
        child.kill()
        child.wait()
    assert start_ticks(child.pid) is None  # reaped: no process, no identity


class _Notified:
    """Records what the dispatcher was asked to notify."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []

    def on_transition(self, t, notify: bool = True) -> None:  # noqa: ANN001
        self.calls.append((t.subject, t.to_state, notify))

    def close(self, timeout_s: float = 5.0) -> None:
        return


@pytest.mark.unit
def test_one_leak_in_one_process_is_one_notification_the_gpu_is_context() -> None:
    # Issue 19.6: the GPU and its process both opening gave two notifications.
    from otel_gpu.actions.notifiers import format_text
    from otel_gpu.detect.model import Alert

    uuid = "GPU-0c0c0c0c-0000-4000-8000-000000000000"
    notified = _Notified()
    wd = Watchdog(Engine(), Breaker(), dispatcher=notified)
    snap = Snapshot(
        time=100.0,
        gpus=(GpuSample(uuid, 0, memory_used=8 * GIB, memory_total=80 * GIB),),
        gpu_processes=(GpuProcessSample(42, uuid, used_memory=6 * GIB),),
        processes=(ProcessSample(42, memory_rss=GIB),),
    )
    wd.on_snapshot(snap)  # both subjects are known now
    process, gpu = f"process:42@{uuid}", f"gpu:{uuid}"
    opened = []
    for subject in (gpu, process):  # the GPU's transition comes first in a sweep
        alert = Alert("leak", subject, 110.0, "warning", "floor rising 2000 MB/h",
                      rate_bytes_per_s=2e9 / 3600)  # fmt: skip
        opened += wd.breaker.record_alert(alert)
    for t in opened:
        wd._on_transition(t)
    assert notified.calls == [(gpu, "open", False), (process, "open", True)]
    title, body = format_text(opened[1], "job train")
    assert "[job train]" in title and uuid in title and "2000 MB/h" in body
    assert "/s" not in body
    # A GPU leaking on its own still notifies.
    other = "GPU-0d0d0d0d-0000-4000-8000-000000000000"
    alone = wd.breaker.record_alert(Alert("leak", f"gpu:{other}", 120.0, "warning", "rising"))
    for t in alone:
        wd._on_transition(t)
    assert notified.calls[-1] == (f"gpu:{other}", "open", True)


@pytest.mark.unit
def test_detection_settings_name_the_jobs_service() -> None:
    assert DetectionSettings.load({"OTEL_SERVICE_NAME": "train"}).service == "train"
    assert DetectionSettings.load({}).service == ""
