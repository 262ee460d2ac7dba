"""Which processes a stop may signal, and the PID-reuse guard: pure logic, lookups injected."""

from __future__ import annotations

import pytest

from otel_gpu.actions.trainers import Trainers, still_the_same, trainers_of
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

pytestmark = pytest.mark.unit

GPU = (GpuSample(uuid="G", index=0, processes_listed=True),)


def _on_gpu(*pids: int) -> tuple[GpuProcessSample, ...]:
    return tuple(GpuProcessSample(pid=p, gpu_uuid="G", used_memory=1) for p in pids)


def _proc(pid: int, ticks: int | None = 100, in_tree: bool = True) -> ProcessSample:
    return ProcessSample(pid=pid, start_ticks=ticks, in_tree=in_tree)


@pytest.mark.parametrize(
    ("snap", "trainers"),
    [
        # the rank on the GPU, not its launcher above it
        (Snapshot(1.0, GPU, _on_gpu(20), (_proc(10), _proc(20, 7))), {20: 7}),
        # a process on the GPU outside the watched tree (another tenant): never
        (Snapshot(1.0, GPU, _on_gpu(30), (_proc(30, in_tree=False),)), {}),
        # NVML's host PID mapped to the PID the job's namespace sees
        (
            Snapshot(1.0, GPU, _on_gpu(9020), (_proc(20),), host_to_local={9020: 20}),
            {20: 100},
        ),
        # no GPU processes (no GPU visible): nothing is signalled
        (Snapshot(1.0, (), (), (_proc(10), _proc(20))), {}),
        # start time unknown: still a trainer, never verified (below)
        (Snapshot(1.0, GPU, _on_gpu(20), (_proc(20, None),)), {20: None}),
    ],
    ids=["rank-not-launcher", "outside-tree", "namespaced-pid", "no-gpu", "unknown-start"],
)
def test_trainers_are_watched_processes_on_a_gpu(snap: Snapshot, trainers: dict) -> None:
    assert trainers_of(snap) == trainers


@pytest.mark.parametrize(
    ("seen", "now", "verified"),
    [
        ({20: 100}, {20: 100}, {20}),  # the same process
        ({20: 100}, {20: 101}, set()),  # PID reused one tick later
        ({20: 100}, {}, set()),  # gone
        ({20: None}, {20: 100}, set()),  # start unknown at the sweep
        ({20: 100, 21: 200}, {20: 100, 21: 201}, {20}),
    ],
)
def test_only_trainers_with_the_start_time_they_were_seen_with_are_verified(
    seen: dict, now: dict, verified: set
) -> None:
    assert still_the_same(seen, now.get) == verified


def test_trainers_follow_the_latest_sweep() -> None:
    ticks = {20: 100, 21: 100}
    trainers = Trainers(ticks.get)
    trainers.update(Snapshot(1.0, GPU, _on_gpu(20, 21), (_proc(20), _proc(21))))
    assert trainers.pids == {20, 21} and trainers.verified() == {20, 21}
    ticks[21] = 555  # 21 exited and its PID was reused
    assert trainers.verified() == {20}
    trainers.update(Snapshot(2.0, GPU, (), (_proc(20),)))  # 20 released the GPU
    assert trainers.pids == set() and trainers.verified() == set()
