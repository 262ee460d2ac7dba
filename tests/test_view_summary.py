"""The live view's frame and the end-of-run summary: pure parts with tables, then the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import CLI, clean_env

from otel_gpu.detect.breaker import Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import Alert, Point
from otel_gpu.outputs.summary import RunSummary
from otel_gpu.outputs.sweeps import Sweep
from otel_gpu.outputs.view.frame import MAX_PROCESS_ROWS, build_frame
from otel_gpu.outputs.view.render import plain_line
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

GIB = 1 << 30
U0 = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
U1 = "GPU-bbbbbbbb-0000-4000-8000-000000000000"


def snapshot(n_procs: int) -> Snapshot:
    gpus = (
        GpuSample(U0, 0, "NVIDIA H100 80GB HBM3", memory_used=40 * GIB, memory_total=80 * GIB,
                  util_gpu=0.95, power_w=600.0, temperature_c=70.0),
        GpuSample(U1, 1, "NVIDIA H100 80GB HBM3", status="failed"),
    )  # fmt: skip
    # NVML's host PIDs 1000+i are PIDs 10+i in the agent's namespace.
    gpu_procs = tuple(GpuProcessSample(1000 + i, U0, used_memory=i * GIB) for i in range(n_procs))
    procs = tuple(
        ProcessSample(10 + i, executable_name=f"rank{i}", cpu_utilization=0.5, memory_rss=GIB)
        for i in range(n_procs)
    )
    return Snapshot(
        time=1000.0,
        gpus=gpus,
        gpu_processes=gpu_procs,
        processes=procs,
        host_to_local={1000 + i: 10 + i for i in range(n_procs)},
    )


@pytest.mark.unit
def test_frame_rows_biggest_processes_first_local_pids_and_breaker_states() -> None:
    breaker = Breaker()
    breaker.record_alert(Alert("leak", f"gpu:{U0}", 990.0, "warning", "floor rising"))
    snap = snapshot(MAX_PROCESS_ROWS + 2)
    points = [(f"gpu:{U0}", Point(1000.0, phase="train"))] + [
        (f"process:{gp.pid}@{U0}", Point(1000.0)) for gp in snap.gpu_processes
    ]
    frame = build_frame(Sweep(snap, points, Engine(), breaker), started=940.0)
    assert [g.label for g in frame.gpus] == ["GPU0 aaaaaaaa", "GPU1 bbbbbbbb"]
    assert [g.state for g in frame.gpus] == ["open", "failed"]
    assert [p.pid for p in frame.processes] == [10 + i for i in range(9, 1, -1)]
    assert frame.processes[0].name == "rank9" and frame.processes[0].used == 9 * GIB
    assert frame.hidden_processes == 2
    assert frame.breakers == {"open": 1} and frame.worst == "GPU0 aaaaaaaa H100 80GB HBM3"
    assert frame.elapsed_s == 60.0 and frame.phase == "train"
    line = plain_line(frame, "otel-gpu run x")
    assert line.startswith("otel-gpu run x up 00:01:00 phase train | GPU0 aaaaaaaa 40.0/80.0 GiB")
    assert "rank9 19 GPU0 9.0 GiB floor - cpu 50% rss 1.0 GiB" in line
    assert "breaker 1 open (GPU0 aaaaaaaa H100 80GB HBM3)" in line


@pytest.mark.unit
@pytest.mark.parametrize(
    ("slope", "minutes", "expected"),
    [
        (400e6 / 3600, 60, 400e6 / 3600),  # a steady 400 MB/h: the slope, exactly
        (0.0, 60, 0.0),  # flat
        (400e6 / 3600, 4, None),  # too few closed buckets to say
    ],
)
def test_floor_trend_is_the_slope_of_the_engines_floor(slope, minutes, expected) -> None:
    engine = Engine()  # 60 s buckets
    for i in range(minutes * 6):  # one point per 10 s; a per-batch spike on every 3rd
        t = 10.0 * i
        spike = 2 * GIB if i % 3 == 0 else 0
        engine.observe("process:1@GPU-x", Point(t, used_bytes=20 * GIB + slope * t + spike))
    trend = engine.floor_trend("process:1@GPU-x")
    assert trend is not None and trend.floor >= 20 * GIB
    if expected is None:
        assert trend.rate is None
    else:
        assert trend.rate == pytest.approx(expected, abs=1.0)
        assert trend.window_s > 600


@pytest.mark.unit
@pytest.mark.parametrize(("minutes", "shown"), [(20, False), (31, True)])
def test_the_view_shows_a_floor_rate_only_once_the_detector_could_mean_it(minutes, shown) -> None:
    # Issue 19.6: a rate after a few minutes (a warm-up ramp) is not shown; once the view has
    # watched for the shortest window the leak detector alerts from (30 min here), it is.
    from otel_gpu.detect.settings import DetectConfig

    engine = Engine(DetectConfig(leak_min_window_s=1800.0, leak_urgent_window_s=1800.0))
    snap = snapshot(1)
    subject = f"process:1000@{U0}"
    for i in range(minutes * 6):
        t = 10.0 * i
        engine.observe(subject, Point(t, used_bytes=20 * GIB + 400e6 / 3600 * t))
    trend = engine.floor_trend(subject)
    assert trend is not None and trend.rate is not None  # the engine has a slope either way
    # watched for `minutes` (the view's first sweep that long before this one)
    sweep = Sweep(snap, [(subject, Point(1000.0))], engine, Breaker())
    frame = build_frame(sweep, started=1000.0 - 60.0 * minutes)
    assert (frame.processes[0].trend is not None) == shown


@pytest.mark.unit
def test_a_process_that_just_exited_keeps_its_name_while_nvml_still_lists_it() -> None:
    seen: dict[int, str] = {}
    first = build_frame(Sweep(snapshot(2), [], None, None), started=1000.0, seen=seen)
    assert [p.name for p in first.processes] == ["rank1", "rank0"]
    # The job exited: the process tree no longer has PID 11, NVML still lists host PID 1001.
    gone = dataclasses.replace(snapshot(2), processes=snapshot(2).processes[:1])
    frame = build_frame(Sweep(gone, [], None, None), started=1000.0, seen=seen)
    assert [(p.pid, p.name) for p in frame.processes] == [(11, "rank1"), (10, "rank0")]
    # Without what was seen (a first frame), the name is unknown, and said so.
    alone = build_frame(Sweep(gone, [], None, None), started=1000.0)
    assert [p.name for p in alone.processes] == ["?", "rank0"]
    assert set(seen) == {10, 11}  # only the rows' PIDs are kept


@pytest.mark.unit
def test_frame_without_detection_says_so() -> None:
    frame = build_frame(Sweep(snapshot(1), [], None, None), started=1000.0)
    assert not frame.detecting and frame.processes[0].trend is None
    assert plain_line(frame, "t").endswith(" | detection off (--no-detect)")


def _feed(summary: RunSummary, subject: str, samples: list[tuple[float, float | None, float]]):
    for t, util, used in samples:
        summary.observe(subject, Point(t, used_bytes=used, limit_bytes=100.0, util=util), "x")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("samples", "busy", "idle", "peak", "final"),
    [
        # util holds until the next sample: 10 s idle, 20 s busy
        ([(0, 0.0, 5), (10, 0.9, 9), (20, 0.9, 7), (30, 0.0, 6)], 2 / 3, 1 / 3, 9, 6),
        # unknown utilization counts as neither
        ([(0, None, 5), (10, 0.5, 5), (20, None, 5)], 1.0, 0.0, 5, 5),
        # a gap longer than a minute counts for one minute
        ([(0, 0.05, 1), (600, 0.9, 2), (610, 0.9, 3)], 10 / 70, 60 / 70, 3, 3),
    ],
)
def test_utilization_profile_peak_and_final(samples, busy, idle, peak, final) -> None:
    summary = RunSummary()
    _feed(summary, f"gpu:{U0}", samples)
    _feed(summary, "rss:42", samples)  # host memory is not part of the GPU summary
    (gpu,) = summary.to_dict()["gpus"]
    assert gpu["busy_fraction"] == pytest.approx(busy)
    assert gpu["idle_fraction"] == pytest.approx(idle)
    assert (gpu["peak_bytes"], gpu["final_bytes"]) == (peak, final)
    assert list(summary.series) == [f"gpu:{U0}"]


@pytest.mark.process
def test_run_prints_the_summary_and_writes_it_as_json(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    res = subprocess.run(
        [*CLI, "run", "--simulate", "leak", "--exporter", "none", "--interval", "0.2",
         "--summary-json", str(out), "--", sys.executable, "-c",
         "import time; time.sleep(2); raise SystemExit(3)"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 3
    data = json.loads(out.read_text())
    assert data["exit_code"] == 3 and 1.5 < data["duration_s"] < 30
    assert data["command"][1:] == ["-c", "import time; time.sleep(2); raise SystemExit(3)"]
    (gpu,) = data["gpus"]
    assert gpu["label"] == "GPU0 51a1a7ed Simulated H100 80GB" and gpu["limit_bytes"] == 80 * GIB
    assert 0 < gpu["final_bytes"] <= gpu["peak_bytes"]
    assert gpu["busy_fraction"] + gpu["idle_fraction"] == pytest.approx(1.0)
    (proc,) = data["processes"]
    assert " on GPU0" in proc["label"] and proc["peak_bytes"] > 0
    assert data["alerts"] == [] and set(data["actions"]) == {
        "notifications_delivered", "notifications_failed", "notifications_dropped",
        "stops_requested", "stops_refused",
    }  # fmt: skip
    summary = res.stderr[res.stderr.index("otel-gpu summary") :]
    assert "exit code 3" in summary.splitlines()[0]
    assert "GPU0 51a1a7ed Simulated H100 80GB" in summary and "alerts: 0" in summary


@pytest.mark.process
def test_quiet_prints_nothing_but_still_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    res = subprocess.run(
        [*CLI, "run", "--simulate", "steady", "--exporter", "none", "--interval", "0.2",
         "--quiet", "--summary-json", str(out), "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0
    assert res.stderr == "" and res.stdout == ""
    assert json.loads(out.read_text())["exit_code"] == 0


@pytest.mark.process
def test_summary_json_in_a_missing_folder_is_refused_up_front(tmp_path: Path) -> None:
    res = subprocess.run(
        [*CLI, "run", "--simulate", "steady", "--exporter", "none", "--summary-json",
         str(tmp_path / "nope" / "s.json"), "--", "true"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 2 and "--summary-json" in res.stderr
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr


@pytest.mark.unit
@pytest.mark.parametrize("gpus", [0, 1])
def test_a_summary_without_any_gpu_says_so_instead_of_an_empty_table(gpus: int) -> None:
    import io

    from rich.console import Console

    from otel_gpu.outputs.summary import render

    seen = [
        {"label": "GPU0 H100", "peak_bytes": 2e9, "final_bytes": 1e9, "floor_rate_bytes_per_s": 0}
    ][:gpus]
    out = io.StringIO()
    data = {"gpus": seen, "processes": [], "alerts": [], "transitions": [], "duration_s": 3.0}
    render(data, Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    assert ("GPUs: none seen" in text) is (gpus == 0)
    assert ("peak" in text and "GPU0 H100" in text) is (gpus == 1)
