"""`--record FILE`: a recording replays the live run exactly (`otel-gpu analyze`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from support.cli import CLI, clean_env
from support.recording import FAST_LEAK_WINDOWS, record_simulated_leak

from otel_gpu.detect.model import Point
from otel_gpu.detect.trace import read_rows
from otel_gpu.outputs.record import Recorder


def analyze(*args: str) -> list[dict]:
    res = subprocess.run(
        [*CLI, "analyze", *args], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.mark.peers
def test_recording_holds_exactly_the_points_the_engine_judged_and_replays_its_alerts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "leak.csv"
    live = record_simulated_leak(path)
    leaks = [a for a in live["alerts"] if a.kind == "leak"]
    assert leaks, "the simulated leak was not found live"
    rows = read_rows(path)
    # Every point, bit for bit (floats round-trip), in the order the engine saw them.
    assert [(r.subject, r.point) for r in rows] == live["points"]
    assert {r.subject.split(":")[0] for r in rows if r.subject} == {"gpu", "process", "rss"}
    first = {r.subject: r.label for r in rows if r.label}
    assert any(label.startswith("GPU0 51a1a7ed") for label in first.values())
    # `otel-gpu analyze` on the recording: the same alerts, subjects and data times.
    config = tmp_path / "detect.json"
    config.write_text(json.dumps(FAST_LEAK_WINDOWS))
    replayed = analyze("--config", str(config), str(path))
    assert [(x["kind"], x["subject"], x["time_s"], x["message"]) for x in replayed] == [
        (a.kind, a.subject, a.time, a.message) for a in live["alerts"]
    ]


@pytest.mark.peers
def test_run_record_and_summary_json_agree_with_analyze(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # Hot and nearly full from the second second on: temperature and memory threshold alerts.
    fake_nvml.write(
        """
        gpu.0.memory.total = 85899345920
        gpu.0.memory.used = steps 0:40000000000 1:82000000000+400000000/s
        gpu.0.temperature = steps 0:60 1:95
        gpu.0.util.gpu = 90
        """
    )
    record, summary = tmp_path / "run.csv", tmp_path / "summary.json"
    res = subprocess.run(
        [*CLI, "run", "--exporter", "none", "--interval", "0.2", "--record", str(record),
         "--summary-json", str(summary), "--", sys.executable, "-c",
         "import time; time.sleep(5); raise SystemExit(3)"],
        capture_output=True, text=True, timeout=60, env=fake_nvml.env(clean_env()),
    )  # fmt: skip
    assert res.returncode == 3, res.stderr
    data = json.loads(summary.read_text())
    live = [(a["kind"], a["subject"], a["time"]) for a in data["alerts"]]
    assert {kind for kind, _, _ in live} == {"threshold"} and len(live) == 2
    replayed = analyze(str(record))
    assert [(x["kind"], x["subject"], x["time_s"]) for x in replayed] == live


@pytest.mark.process
def test_unwritable_record_path_is_refused_before_the_job_starts(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    res = subprocess.run(
        [*CLI, "run", "--simulate", "steady", "--exporter", "none", "--record",
         str(tmp_path / "no" / "such" / "dir.csv"), "--", sys.executable, "-c",
         f"open({str(marker)!r}, 'w')"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().startswith("otel-gpu: error: --record ")
    assert "give a writable file path" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not marker.exists()


@pytest.mark.unit
def test_a_stalled_disk_drops_whole_sweeps_and_never_blocks_the_sampler() -> None:
    import os

    from otel_gpu.outputs.sweeps import Sweep
    from otel_gpu.sampling.snapshot import GpuSample, Snapshot

    read_end, write_end = os.pipe()  # a "file" nobody drains
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(write_end, True)
    recorder = Recorder(os.fdopen(write_end, "w", newline=""))
    snap = Snapshot(time=1.0, gpus=(GpuSample("GPU-1", 0),))
    sweep = Sweep(snap, [("gpu:GPU-1", Point(1.0, used_bytes=1.0))], None, None)
    began = time.monotonic()
    for _ in range(1000):
        recorder.on_sweep(sweep)
    assert time.monotonic() - began < 5  # queued or dropped, never waited on
    assert recorder.dropped_sweeps >= 1000 - 256 - 1
    recorder.close(timeout_s=0.2)  # bounded although the writer is stuck
    os.close(read_end)


FORMULA = "=cmd|' -C calc'!A0"  # what a spreadsheet would run, as a program's file name


@pytest.mark.process
def test_a_formula_in_a_name_is_written_as_text_and_read_back_exactly(tmp_path: Path) -> None:
    import csv
    import shutil

    program = tmp_path / FORMULA
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, program)
    recording = tmp_path / "run.csv"
    res = subprocess.run(
        [*CLI, "run", "--quiet", "--simulate", "steady", "--exporter", "none", "--interval", "0.2",
         "--record", str(recording), "--", str(program), "1.5"],
        capture_output=True, text=True, timeout=60, env=clean_env(OTEL_GPU_LOCK_DIR=str(tmp_path)),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    with recording.open(newline="") as fh:
        cells = [cell for row in csv.reader(fh) for cell in row]
    # No cell starts as a formula, numbers included (none is negative here).
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r")]
    assert any(c.startswith("'" + FORMULA) for c in cells)
    labels = {row.label for row in read_rows(recording) if row.label}
    assert any(label.startswith(FORMULA + " ") for label in labels)  # exactly the name
    analyzed = subprocess.run(
        [*CLI, "analyze", str(recording)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert analyzed.returncode == 0, analyzed.stderr


@pytest.mark.process
def test_every_text_round_trips_and_none_is_a_formula(tmp_path: Path) -> None:
    import csv

    from otel_gpu.detect.trace import read_text_cell, text_cell

    texts = ["=1+1", "+1", "-2", "@SUM(A1)", "'=x", "'", "''a", "\tx", "plain", "a=b", " =x"]
    path = tmp_path / "cells.csv"
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([[text_cell(t)] for t in texts])
    with path.open(newline="") as fh:
        written = [row[0] for row in csv.reader(fh)]
    assert not [c for c in written if c.lstrip(" ")[:1] in ("=", "+", "-", "@", "\t", "\r")]
    assert [read_text_cell(c) for c in written] == texts


@pytest.mark.unit
def test_a_diagnosed_alert_is_recorded_redacted_and_the_report_lists_it(tmp_path: Path) -> None:
    from otel_gpu.detect.model import Alert, Diagnosis
    from otel_gpu.outputs.record import open_recording, read_comments
    from otel_gpu.outputs.report.page import alerts_table
    from otel_gpu.outputs.report.replay import Run

    path = tmp_path / "run.csv"
    recorder = Recorder(open_recording(str(path)))
    found = Diagnosis(
        "stall",
        (
            "rank 1 (PID 42) in fetch_remote_shard at data.py:88",
            "ranks 0, 2 in all_reduce at t.py:9",
        ),
        took_s=0.1,
    )
    secret = "--token=ghp_abcdefghijklmnopqrstuvwxyz0123456789"
    stall = Alert("stall", "gpu:GPU-1", 120.0, "critical", f"stalled {secret}", diagnosis=found)
    recorder.on_alert(stall)
    recorder.on_alert(Alert("leak", "gpu:GPU-1", 130.0, "warning", "no diagnosis here"))
    recorder.close()
    text = path.read_text()
    assert text.count("# otel-gpu diagnosis ") == 1 and "ghp_abcdefghij" not in text
    context, diagnoses = read_comments(str(path))
    assert context == {}  # no context line was written: the diagnoses are kept apart
    [e] = diagnoses
    assert (e["kind"], e["subject"], e["time"]) == ("stall", "gpu:GPU-1", 120.0)
    assert e["diagnosis"]["lines"] == list(found.lines) and e["diagnosis"]["took_s"] == 0.1
    run = Run("run.csv", {}, [stall], [], {}, 100.0, 200.0, diagnoses=diagnoses)
    table = alerts_table(run)
    assert "stall diagnosis" in table and "fetch_remote_shard at data.py:88" in table


@pytest.mark.unit
def test_a_recording_keeps_a_bounded_number_of_diagnoses(tmp_path: Path) -> None:
    from otel_gpu.detect.model import Alert, Diagnosis
    from otel_gpu.outputs.record import MAX_DIAGNOSES, open_recording, read_comments

    path = tmp_path / "run.csv"
    recorder = Recorder(open_recording(str(path)))
    found = Diagnosis("memory", ("model._cache: +600 tensors",), took_s=0.2)
    for i in range(MAX_DIAGNOSES + 50):
        recorder.on_alert(Alert("leak", f"rss:{i}", float(i), "warning", "leak", diagnosis=found))
    recorder.close()
    assert path.read_text().count("# otel-gpu diagnosis ") == MAX_DIAGNOSES
    with path.open("a") as f:  # a damaged line and one without its diagnosis are passed over
        f.write('# otel-gpu diagnosis {not json\n# otel-gpu diagnosis {"time": 1}\n')
    _, diagnoses = read_comments(str(path))
    assert len(diagnoses) == MAX_DIAGNOSES and diagnoses[0]["subject"] == "rss:0"
