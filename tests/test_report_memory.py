"""A leak alert's memory diagnosis is kept in the recording (a ``# otel-gpu diagnosis`` line)
and `otel-gpu report FILE` shows it as "Where the memory went" (issue 20 §4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_gpu.agent.memory_diagnosis import diagnosis_from
from otel_gpu.cli import main
from otel_gpu.detect.model import LEAK, Alert, Point
from otel_gpu.outputs.record import Recorder, open_recording, read_comments
from otel_gpu.outputs.sweeps import Sweep
from otel_gpu.sampling.snapshot import Snapshot

pytestmark = pytest.mark.unit

HOLDER = {
    "path": "train.model.encoder._cache", "root": "global", "site": "train.py", "count": 900,
    "bytes": 9 << 20, "grad_fn": 0, "growth_count": 600,
    "growth_bytes": 6 << 20, "growing": True, "devices": {"cpu": 9 << 20},
    "dtypes": {"float32": 900},
}  # fmt: skip
STILL = {**HOLDER, "path": "train.replay", "growth_count": 0, "growth_bytes": 0, "growing": False}


def test_the_diagnosis_is_kept_in_the_recording_and_reported(tmp_path: Path) -> None:
    recording = tmp_path / "run.csv"
    recorder = Recorder(open_recording(str(recording)))
    for i in range(30):
        point = Point(60.0 * i, used_bytes=1e9 + 1e6 * i)
        recorder.on_sweep(Sweep(Snapshot(time=60.0 * i), [("rss:42", point)], None, None))
    reply = {
        "over_s": 65.0,
        "holders": [HOLDER, STILL],
        "lines": ["train.model.encoder._cache: +600 tensors"],
    }
    found = diagnosis_from(42, reply, 1.5)
    recorder.on_alert(
        Alert(LEAK, "rss:42", 1500.0, "warning", "memory leak suspected", diagnosis=found)
    )
    recorder.on_alert(Alert(LEAK, "rss:43", 1500.0, "warning", "no diagnosis here"))  # not kept
    recorder.close()
    assert not list(tmp_path.glob("run.csv.*"))  # one file: the recording
    [kept] = read_comments(str(recording))[1]
    assert kept["subject"] == "rss:42" and kept["diagnosis"]["data"]["growing"] == [HOLDER["path"]]
    out = tmp_path / "report.html"
    assert main(["report", str(recording), "-o", str(out)]) == 0
    page = out.read_text()
    assert "<h3>Where the memory went</h3>" in page
    section = page.split("Where the memory went")[1]
    assert "train.model.encoder._cache" in section and "+600" in section and "+6.0 MiB" in section
    assert "train.replay" not in section  # not growing: not where the memory went


def test_a_recording_without_diagnoses_has_no_such_table(tmp_path: Path) -> None:
    recording = tmp_path / "run.csv"
    recorder = Recorder(open_recording(str(recording)))
    for i in range(30):
        point = Point(60.0 * i, used_bytes=1e9)
        recorder.on_sweep(Sweep(Snapshot(time=60.0 * i), [("rss:42", point)], None, None))
    recorder.close()
    assert read_comments(str(recording))[1] == []
    out = tmp_path / "report.html"
    assert main(["report", str(recording), "-o", str(out)]) == 0
    assert "Where the memory went" not in out.read_text()


def test_the_figures_of_a_run_share_its_time_axis(tmp_path: Path) -> None:
    """A run's figures stand one above the other: the same time range on each, whichever
    series starts late (a process appearing after the GPU) or ends early."""
    from otel_gpu.detect.trace import read_rows
    from otel_gpu.outputs.report.plots import activity_figure, memory_figure, training_figure
    from otel_gpu.outputs.report.replay import replay_recording

    recording = tmp_path / "run.csv"
    recorder = Recorder(open_recording(str(recording)))
    for i in range(40):
        t = 1000.0 + 15.0 * i
        points = [("gpu:GPU-1", Point(t, used_bytes=1e9, limit_bytes=8e10, util=0.9, step=i))]
        if 10 <= i < 30:
            points.append(("process:42@GPU-1", Point(t, used_bytes=5e8)))
        recorder.on_sweep(Sweep(Snapshot(time=t), points, None, None))
    recorder.close()
    run = replay_recording(str(recording), read_rows(str(recording)))
    figures = [memory_figure(run), activity_figure(run), training_figure(run)]
    limits = {tuple(round(x, 6) for x in f.axes[0].get_xlim()) for f in figures if f}
    assert limits == {(0.0, round(39 * 15.0 / 60, 6))}
