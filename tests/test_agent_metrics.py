"""The sampler and the instrument table, read through the real OTel SDK."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.sdk_metrics import collect

from otel_gpu.agent import instruments as metrics
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.sim import GIB, SimulatedSource
from otel_gpu.sampling.snapshot import (
    STATUS_FAILED,
    GpuProcessSample,
    GpuSample,
    ProcessSample,
    Snapshot,
)


@pytest.fixture()
def child() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.process
def test_simulated_job_exports_every_device_and_process_instrument(child: subprocess.Popen) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    source = SimulatedSource("steady", time_scale=600.0)
    agent = Agent(
        Settings(interval_s=0.1, detect=False),
        meter_provider=provider,
        roots=[child.pid],
        source=source,
    )
    agent.sampler.sample_once()
    time.sleep(0.2)
    snap = agent.sampler.sample_once()
    got = collect(reader)

    g = snap.gpus[0]
    assert got["hw.gpu.memory.limit"] == [(80 * GIB, metrics.gpu_attrs(g), "By")]
    assert got["hw.gpu.memory.usage"][0][0] == g.memory_used
    assert got["hw.gpu.memory.utilization"][0][0] == pytest.approx(g.memory_used / (80 * GIB))
    tasks = {a["hw.gpu.task"]: v for v, a, unit in got["hw.gpu.utilization"]}
    assert set(tasks) == {"general", "encoder", "decoder"}
    assert 0.0 <= tasks["general"] <= 1.0
    assert got["hw.power"][0][2] == "W" and got["hw.temperature"][0][2] == "Cel"
    assert got["hw.energy"][0][2] == "J" and got["hw.energy"][0][0] > 0
    assert {a["error.type"] for _, a, _ in got["hw.errors"]} == {"corrected", "uncorrected", "xid"}
    states = {a["hw.state"]: v for v, a, _ in got["hw.status"]}
    assert states == {"ok": 1, "degraded": 0, "failed": 0}
    assert got["hw.gpu.memory.usage"][0][1]["hw.id"] == g.uuid

    # Per-process series for the real child process: GPU memory and /proc data.
    (gpu_mem,) = got["process.gpu.memory.usage"]
    assert gpu_mem[1]["process.pid"] == child.pid and gpu_mem[1]["hw.id"] == g.uuid
    assert gpu_mem[1]["process.executable.name"].startswith("python")
    rss = {a["process.pid"]: v for v, a, _ in got["process.memory.usage"]}
    assert rss[child.pid] > 1_000_000
    threads = {a["process.pid"]: v for v, a, _ in got["process.thread.count"]}
    assert threads[child.pid] >= 1
    assert any(
        a["process.pid"] == child.pid for _, a, _ in got["process.unix.file_descriptor.count"]
    )
    assert got["process.cpu.utilization"][0][2] == "1"


@pytest.mark.unit
def test_unknown_values_are_skipped_not_zero() -> None:
    snap = Snapshot(
        time=1.0,
        gpus=(GpuSample(uuid="GPU-a", index=0, memory_used=5, memory_total=None),),
        gpu_processes=(GpuProcessSample(pid=4242, gpu_uuid="GPU-a", used_memory=None),),
        processes=(ProcessSample(pid=4242, memory_rss=None, thread_count=3),),
    )
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.register(provider.get_meter("t"), lambda: snap)
    got = collect(reader)
    assert "hw.power" not in got and "hw.temperature" not in got and "hw.energy" not in got
    assert "hw.gpu.memory.limit" not in got and "hw.gpu.memory.utilization" not in got
    assert [v for v, _, _ in got["hw.gpu.memory.usage"]] == [5]
    assert "process.gpu.memory.usage" not in got and "process.memory.usage" not in got
    assert [v for v, _, _ in got["process.thread.count"]] == [3]


@pytest.mark.unit
def test_failed_gpu_reports_failed_status_while_others_flow() -> None:
    snap = Snapshot(
        time=1.0,
        gpus=(
            GpuSample(uuid="GPU-lost", index=0, status=STATUS_FAILED),
            GpuSample(uuid="GPU-ok", index=1, memory_used=7, memory_total=10),
        ),
    )
    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: snap)
    got = collect(reader)
    status = {(a["hw.id"], a["hw.state"]): v for v, a, _ in got["hw.status"]}
    assert status[("GPU-lost", "failed")] == 1 and status[("GPU-lost", "ok")] == 0
    assert status[("GPU-ok", "ok")] == 1
    assert [a["hw.id"] for _, a, _ in got["hw.gpu.memory.usage"]] == ["GPU-ok"]


@pytest.mark.unit
def test_throttle_reasons_are_decoded_and_reported_until_cleared() -> None:
    current = [
        Snapshot(time=1.0, gpus=(GpuSample(uuid="G", index=0, throttle_reasons=0x4 | 0x40),))
    ]
    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: current[0])
    got = {a["otel_gpu.throttle.reason"]: v for v, a, _ in collect(reader)["otel_gpu.gpu.throttle"]}
    assert got == {"sw_power_cap": 1, "hw_thermal_slowdown": 1}
    # The thermal slowdown clears: it reads 0 (not stale), and never-seen reasons stay absent.
    current[0] = Snapshot(time=2.0, gpus=(GpuSample(uuid="G", index=0, throttle_reasons=0x4),))
    got = {a["otel_gpu.throttle.reason"]: v for v, a, _ in collect(reader)["otel_gpu.gpu.throttle"]}
    assert got == {"sw_power_cap": 1, "hw_thermal_slowdown": 0}


@pytest.mark.unit
def test_unmapped_gpu_process_is_reported_under_its_host_pid() -> None:
    snap = Snapshot(
        time=1.0,
        gpus=(GpuSample(uuid="G", index=0),),
        gpu_processes=(GpuProcessSample(pid=987654, gpu_uuid="G", used_memory=123),),
        unmapped_gpu_pids=(987654,),
    )
    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: snap)
    assert collect(reader)["process.gpu.memory.usage"] == [
        (123, {"process.pid": 987654, "hw.id": "G"}, "By")
    ]


@pytest.mark.process
def test_forked_child_exports_no_agent_series(tmp_path: Any) -> None:
    """A DataLoader-style fork must not report the parent's device and process series."""
    snap = Snapshot(time=1.0, gpus=(GpuSample(uuid="G", index=0, memory_used=1, memory_total=2),))
    reader = InMemoryMetricReader()
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: snap)
    assert "hw.gpu.memory.usage" in collect(reader)
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # child: collect as the SDK's restarted reader would
        try:
            out.write_text(",".join(sorted(collect(reader))))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert out.read_text() == ""
    assert "hw.gpu.memory.usage" in collect(reader)  # the parent still reports


class _Boom:
    calls = 0

    def __call__(self, snap: Snapshot) -> None:
        self.calls += 1
        raise RuntimeError("listener bug")


@pytest.mark.unit
def test_sampler_survives_a_failing_listener_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=0.1)
    boom = _Boom()
    sampler.add_listener(boom)
    for _ in range(3):
        sampler.sample_once()
    assert boom.calls == 3 and sampler.sweeps == 3
    assert sum("listener" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.unit
def test_sampler_thread_publishes_and_stops_promptly() -> None:
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=0.1)
    sampler.start()
    deadline = time.monotonic() + 5
    while sampler.sweeps < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    began = time.monotonic()
    sampler.stop(2.0)
    assert sampler.sweeps >= 3 and sampler.latest is not None
    assert time.monotonic() - began < 1.0
