"""A GPU that falls off (issue 22.3): GPU_IS_LOST, a device-count drop, a UUID gone, each a
critical job-level alert naming the GPU and the ranks that used it, on the C fake NVML with
real rank processes; an application's Xid names the processes on its GPU and opens nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from fakenvml.fixtures import FakeNvml

from otel_gpu.agent.watchdog import Watchdog, read_rank
from otel_gpu.detect.breaker import CLOSED, OPEN, Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.lost import GpuSeen, GpuUser, LostGpus
from otel_gpu.detect.model import Alert
from otel_gpu.sampling.snapshot import Snapshot


def _rank(rank: int) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, stdin=subprocess.DEVNULL
    )


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen]]:
    procs = [_rank(r) for r in range(3)]
    yield procs
    for p in procs:
        p.kill()
        p.wait(5)


def _watch() -> tuple[Watchdog, list[Alert]]:
    dog = Watchdog(Engine(), Breaker())
    alerts: list[Alert] = []
    dog.alert_listeners.append(alerts.append)
    return dog, alerts


def _sweep(dog: Watchdog, src, now: float) -> None:
    reading = src.sample([])
    dog.on_snapshot(
        Snapshot(
            time=now,
            gpus=reading.gpus,
            gpu_processes=reading.gpu_processes,
            no_gpu_reason=reading.no_gpu_reason,
        )
    )


@pytest.mark.process
def test_a_gpu_lost_and_a_gpu_gone_name_the_gpu_and_its_ranks(
    fake_nvml: FakeNvml, ranks: list[subprocess.Popen]
) -> None:
    pids = [p.pid for p in ranks]
    deadline = time.monotonic() + 10
    while any(read_rank(pid) is None for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)  # the children's environment is readable once they exec'd
    assert [read_rank(pid) for pid in pids] == [0, 1, 2]
    fake_nvml.write(
        "devices = 3\n"
        + "".join(f"gpu.{i}.processes = {pid}:1073741824\n" for i, pid in enumerate(pids))
    )
    src = fake_nvml.source(lost_retry_s=3600)
    dog, alerts = _watch()
    uuids = [g.uuid for g in src.sample([]).gpus]
    _sweep(dog, src, 1000.0)
    _sweep(dog, src, 1005.0)
    assert alerts == []

    fake_nvml.append("fail.*.1 = GPU_IS_LOST")
    _sweep(dog, src, 1010.0)
    _sweep(dog, src, 1015.0)  # once per loss, not once per sweep
    assert len(alerts) == 1
    lost = alerts[0]
    assert lost.severity == "critical" and lost.subject == f"gpu:{uuids[1]}"
    assert lost.evidence["scope"] == "job" and lost.evidence["ranks"] == "1"
    assert f"GPU 1 ({uuids[1]}) is lost" in lost.message and "rank 1" in lost.message
    assert dog.breaker.state(f"gpu:{uuids[1]}") == OPEN

    # GPU 2 disappears from NVML's enumeration (the device count drops from 3 to 2; the lost
    # GPU 1 cannot be enumerated either, and is not announced twice)
    fake_nvml.write(
        "devices = 2\nfail.*.1 = GPU_IS_LOST\n"
        + "".join(f"gpu.{i}.processes = {pid}:1073741824\n" for i, pid in enumerate(pids[:2]))
    )
    _sweep(dog, src, 1020.0)
    assert len(alerts) == 2
    gone = alerts[1]
    assert gone.subject == f"gpu:{uuids[2]}" and gone.evidence["ranks"] == "2"
    assert "fell from 3 to 1" in gone.message and f"pid {pids[2]}" in gone.message
    assert dog.breaker.state(f"gpu:{uuids[0]}") == CLOSED  # the healthy GPU is left alone


@pytest.mark.process
def test_an_application_xid_names_its_processes_and_opens_nothing(
    fake_nvml: FakeNvml, ranks: list[subprocess.Popen]
) -> None:
    pid = ranks[0].pid
    fake_nvml.write(f"devices = 1\ngpu.0.processes = {pid}:1073741824")
    src = fake_nvml.source()
    dog, alerts = _watch()
    _sweep(dog, src, 1000.0)
    fake_nvml.append("gpu.0.xid = 13")
    _sweep(dog, src, 1005.0)
    assert len(alerts) == 1 and alerts[0].severity == "warning"
    assert alerts[0].evidence["pids"] == str(pid) and f"pid {pid}" in alerts[0].message
    assert dog.breaker.state(alerts[0].subject) == CLOSED
    fake_nvml.append("gpu.0.xid = 13 79")  # the fake delivers the list's new tail
    _sweep(dog, src, 1010.0)
    assert alerts[-1].severity == "critical" and dog.breaker.state(alerts[-1].subject) == OPEN


@pytest.mark.unit
def test_nvml_unavailable_loses_no_gpu_and_a_gpu_back_rearms() -> None:
    lost = LostGpus()
    users = {"GPU-a": [GpuUser(10, 0)]}
    assert lost.observe(0, [GpuSeen("GPU-a", 0)], users) == []
    assert lost.observe(5, [], {}, nvml_answers=False) == []  # NVML itself is gone: no verdict
    assert lost.observe(10, [GpuSeen("GPU-a", 0)], users) == []
    first = lost.observe(15, [GpuSeen("GPU-a", 0, failed=True, xid_last=79)], {})
    assert len(first) == 1 and "fallen off the bus" in first[0].message
    assert "rank 0 (pid 10)" in first[0].message  # remembered from the last healthy sweep
    assert lost.observe(20, [GpuSeen("GPU-a", 0)], users) == []  # back: re-armed
    assert len(lost.observe(25, [GpuSeen("GPU-a", 0, failed=True)], {})) == 1
