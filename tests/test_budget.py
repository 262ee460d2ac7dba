"""Adaptive sampling (OTEL_GPU_CPU_BUDGET, otel_gpu/sampling/budget.py): the pure controller on
an injected clock, then the real sampling helper under a CPU hog with NVML made slow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml

from otel_gpu.agent.settings import Settings
from otel_gpu.core.errors import UsageError
from otel_gpu.sampling.budget import PROCESS_DETAILS, PROCESS_GPU_UTIL, BudgetController, HostCpu


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_windows(
    ctl: BudgetController, clock: Clock, cost_pct: float, n: int, busy: float | None = None
) -> None:
    """``n`` windows of 10 s in which the agent used ``cost_pct`` of a core."""
    cpu = getattr(ctl, "_test_cpu", 0.0)
    ctl.observe(lambda: cpu, lambda: busy)  # starts a window the first time
    for _ in range(n):
        clock.t += 10.0
        cpu += cost_pct / 100 * 10.0
        ctl.observe(lambda c=cpu: c, lambda: busy)  # type: ignore[misc]
    ctl._test_cpu = cpu  # type: ignore[attr-defined]


@pytest.mark.unit
def test_backs_off_process_details_first_then_process_gpu_util() -> None:
    clock = Clock()
    ctl = BudgetController(2.0, clock=clock)
    run_windows(ctl, clock, 1.5, 3)
    assert (ctl.every(PROCESS_DETAILS), ctl.every(PROCESS_GPU_UTIL)) == (1, 1)
    run_windows(ctl, clock, 3.0, 1)
    assert (ctl.every(PROCESS_DETAILS), ctl.every(PROCESS_GPU_UTIL)) == (4, 1)
    run_windows(ctl, clock, 3.0, 1)
    assert (ctl.every(PROCESS_DETAILS), ctl.every(PROCESS_GPU_UTIL)) == (4, 4)
    run_windows(ctl, clock, 9.0, 3)  # no further level: GPU reads are never slowed
    assert ctl.intervals(1.0) == (("gpu", 1.0), (PROCESS_DETAILS, 4.0), (PROCESS_GPU_UTIL, 4.0))


@pytest.mark.unit
def test_hysteresis_gives_a_level_back_only_after_calm_windows() -> None:
    clock = Clock()
    ctl = BudgetController(2.0, clock=clock)
    run_windows(ctl, clock, 3.0, 2)
    assert ctl.level == 2
    run_windows(ctl, clock, 1.5, 5)  # under the budget but above half of it: stays
    assert ctl.level == 2
    run_windows(ctl, clock, 0.5, 2)
    assert ctl.level == 2
    run_windows(ctl, clock, 0.5, 1)  # third calm window in a row
    assert ctl.level == 1
    run_windows(ctl, clock, 0.5, 2)
    run_windows(ctl, clock, 3.0, 1)  # pressure again resets the calm count
    assert ctl.level == 2
    run_windows(ctl, clock, 0.5, 6)
    assert ctl.level == 0


@pytest.mark.unit
def test_a_saturated_host_counts_once_the_agent_is_noticeable() -> None:
    clock = Clock()
    ctl = BudgetController(2.0, clock=clock)
    run_windows(ctl, clock, 0.2, 3, busy=0.99)  # a tiny agent: slowing it frees nothing
    assert ctl.level == 0
    run_windows(ctl, clock, 1.2, 1, busy=0.99)  # within its budget, but the host is full
    assert ctl.level == 1
    run_windows(ctl, clock, 1.2, 3, busy=0.5)  # host fine, cost between half and the budget
    assert ctl.level == 1


@pytest.mark.unit
def test_nothing_is_slowed_while_protected_or_with_the_budget_off() -> None:
    clock = Clock()
    ctl = BudgetController(2.0, clock=clock)
    run_windows(ctl, clock, 5.0, 2)
    ctl.protected = True  # a detector suspects a leak or stall
    assert ctl.intervals(0.5) == (("gpu", 0.5), (PROCESS_DETAILS, 0.5), (PROCESS_GPU_UTIL, 0.5))
    ctl.protected = False
    assert ctl.every(PROCESS_DETAILS) == 4
    off = BudgetController(0.0, clock=clock)
    run_windows(off, clock, 50.0, 3)
    assert off.level == 0


@pytest.mark.unit
def test_host_cpu_reads_the_busy_fraction_between_two_reads(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n")
    host = HostCpu(str(tmp_path))
    assert host.busy() is None  # no earlier read
    stat.write_text("cpu  190 0 100 710 100 0 0 0 0 0\n")
    assert host.busy() == pytest.approx(0.9)


@pytest.mark.unit
def test_the_setting_is_a_percent_of_one_core() -> None:
    assert Settings.load({}).cpu_budget == 2.0
    assert Settings.load({"OTEL_GPU_CPU_BUDGET": "0"}).cpu_budget == 0.0
    with pytest.raises(UsageError, match="OTEL_GPU_CPU_BUDGET"):
        Settings.load({"OTEL_GPU_CPU_BUDGET": "150"})


def _intervals(sampler: object) -> dict[str, float]:
    snap = sampler.latest  # type: ignore[attr-defined]
    return dict(snap.intervals) if snap is not None else {}


@pytest.mark.process
def test_the_helper_backs_off_under_a_cpu_hog_with_slow_nvml_and_stops_when_protected(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_gpu.sampling.isolated import SamplerProcess, SamplerSpec

    fake_nvml.write(
        f"""
        devices = 2
        gpu.0.processes = {os.getpid()}:1073741824
        gpu.0.process_util = {os.getpid()}:50:20
        delay.nvmlDeviceGetPowerUsage = 20
        """
    )  # every sweep waits 40 ms on NVML: the helper's cost is real
    for key, value in fake_nvml.env().items():
        monkeypatch.setenv(key, value)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sampler = SamplerProcess(
        SamplerSpec(
            interval_s=0.2,
            nvml_library=str(fake_nvml.library),
            roots=(os.getpid(),),
            cpu_budget=0.05,  # far below what sampling every 0.2 s costs
            budget_window_s=1.0,
        )
    )
    try:
        sampler.start()
        deadline = time.monotonic() + 30
        while _intervals(sampler).get(PROCESS_GPU_UTIL) != pytest.approx(0.8):
            assert time.monotonic() < deadline, f"never backed off: {_intervals(sampler)}"
            time.sleep(0.1)
        got = _intervals(sampler)
        assert got["gpu"] == pytest.approx(0.2)  # GPU reads keep their interval
        assert got[PROCESS_DETAILS] == pytest.approx(0.8)
        snap = sampler.latest
        assert snap is not None and snap.processes and snap.gpu_processes  # still reported
        sampler.protect(True)  # a detector suspects a leak: nothing slowed
        deadline = time.monotonic() + 10
        while _intervals(sampler).get(PROCESS_DETAILS) != pytest.approx(0.2):
            assert time.monotonic() < deadline, f"still backed off: {_intervals(sampler)}"
            time.sleep(0.05)
    finally:
        sampler.stop()
        hog.kill()
        hog.wait()


@pytest.mark.unit
def test_the_live_view_shows_what_the_budget_slowed() -> None:
    from otel_gpu.outputs.view.frame import Frame, slowed_reads
    from otel_gpu.outputs.view.render import header, plain_line

    slowed = slowed_reads((("gpu", 1.0), (PROCESS_DETAILS, 4.0), (PROCESS_GPU_UTIL, 1.0)))
    assert slowed == ((PROCESS_DETAILS, 4.0),)
    frame = Frame(time=1.0, elapsed_s=5.0, phase=None, gpus=(), processes=(), slowed=slowed)
    assert "CPU budget: process details every 4 s" in plain_line(frame, "otel-gpu")
    assert "CPU budget: process details every 4 s" in header(frame, "otel-gpu").plain
    calm = Frame(time=1.0, elapsed_s=5.0, phase=None, gpus=(), processes=(), slowed=slowed_reads(
        (("gpu", 1.0), (PROCESS_DETAILS, 1.0), (PROCESS_GPU_UTIL, 1.0))))  # fmt: skip
    assert "CPU budget" not in plain_line(calm, "otel-gpu")


@pytest.mark.unit
def test_the_agent_protects_the_judged_reads_while_a_breaker_is_not_closed() -> None:
    from otel_gpu.agent.watchdog import DetectionSettings, Watchdog

    dog = Watchdog.build(DetectionSettings())
    assert dog.judging() is False
    dog._states = {"gpu:GPU-0": "closed"}
    assert dog.judging() is False
    dog._states = {"gpu:GPU-0": "half_open"}  # a suspicion still under probation
    assert dog.judging() is True
