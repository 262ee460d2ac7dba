"""The labelled dev traces and `otel-gpu analyze` (a real child process) on them and bad files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.paths import ROOT
from support.tracegen import generate, write_csv
from support.traces import DEV_TRACES

from otel_gpu.detect.engine import Engine
from otel_gpu.detect.trace import read_trace, replay, subject_for


def dev_labels() -> dict:
    labels = DEV_TRACES / "labels.json"
    if not labels.is_file():
        pytest.fail(f"dev traces missing: expected {labels}")
    return json.loads(labels.read_text())


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.unit
def test_dev_traces_every_fault_found_after_onset_and_no_false_alarm():
    labels = dev_labels()
    engine = Engine()
    for name, label in sorted(labels.items()):
        path = DEV_TRACES / name
        alerts = replay(engine, subject_for(path), read_trace(path))
        if label["kind"] == "benign":
            assert alerts == [], (name, [a.message for a in alerts])
            continue
        assert alerts, f"{name}: {label['kind']} not found"
        assert all(a.kind == label["kind"] for a in alerts), (name, [a.message for a in alerts])
        assert alerts[0].time >= label["onset_s"], name
        if "rate_Bps" in label:
            assert alerts[0].rate_bytes_per_s == pytest.approx(label["rate_Bps"], rel=0.35), name


@pytest.mark.process
def test_analyze_reproduces_the_engine_exactly():
    labels = dev_labels()
    files = [str(DEV_TRACES / n) for n in sorted(labels) if not n.startswith("benign")]
    proc = analyze(*files)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    expected = []
    engine = Engine()
    for f in files:
        for a in replay(engine, subject_for(f), read_trace(f)):
            expected.append(
                {
                    "file": f,
                    "kind": a.kind,
                    "time_s": a.time,
                    "rate_bytes_per_s": a.rate_bytes_per_s,
                    "eta_s": a.eta_s,
                    "message": a.message,
                }
            )
    assert lines == expected
    assert {x["kind"] for x in lines} == {"leak", "stall"}
    stall = next(x for x in lines if x["kind"] == "stall")
    assert stall["rate_bytes_per_s"] is None and stall["eta_s"] is None


@pytest.mark.process
def test_analyze_minimal_columns_and_config_file(tmp_path):
    tr = generate("stall_idle", seed=1, interval_s=30.0, columns=("util",), duration_s=4 * 3600)
    csv_path = tmp_path / "job.csv"
    write_csv(tr, csv_path)
    proc = analyze(str(csv_path))
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["kind"] for x in proc.stdout.splitlines()] == ["stall"]
    cfg = tmp_path / "detect.json"
    cfg.write_text('{"stall_enabled": false}')
    proc = analyze("--config", str(cfg), str(csv_path))
    assert (proc.returncode, proc.stdout) == (0, "")
    cfg.write_text('{"stall_window_s": "soon"}')
    proc = analyze("--config", str(cfg), str(csv_path))
    assert proc.returncode == 2 and "stall_window_s" in proc.stderr and str(cfg) in proc.stderr


@pytest.mark.process
@pytest.mark.parametrize(
    ("content", "expect"),
    [
        ("time_s,used\n1,2\n", ":1: header lacks used_bytes"),
        ("time_s,used_bytes,limit_bytes\n1,2,3\n2,abc,3\n", ":3: used_bytes 'abc' is not a number"),
        ("time_s,used_bytes,limit_bytes\n5,2,3\n4,2,3\n", ":3: time goes backwards"),
        ("time_s,used_bytes,limit_bytes,util\n1,2,3\n", ":2: 3 values, header has 4"),
        ("", ":1: empty file"),
    ],
)
def test_analyze_bad_file_one_line_exit_2(tmp_path, content, expect):
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    good = DEV_TRACES / "stall_lowutil_0.csv"
    proc = analyze(str(bad), str(good))
    assert proc.returncode == 2
    # One error line for the bad file; the good one gets its summary line.
    err = [line for line in proc.stderr.strip().splitlines() if "error:" in line]
    assert len(err) == 1 and str(bad) + expect in err[0], proc.stderr
    assert f"otel-gpu: {good}: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [json.loads(x)["kind"] for x in proc.stdout.splitlines()] == [
        "stall"
    ]  # others still run


@pytest.mark.process
def test_analyze_missing_file(tmp_path):
    proc = analyze(str(tmp_path / "nope.csv"))
    assert proc.returncode == 2 and "nope.csv: no such file" in proc.stderr
