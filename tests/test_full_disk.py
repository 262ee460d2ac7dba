"""Outputs on a disk that is full, or fills up during the run (issue 18.3): the wrapper exits
with the job's code whatever happens to ``--record``, ``--summary-json`` or a report, each
output fails alone with one line and no traceback, and the others are written. The disk is
real: ``/dev/full`` (every write: ENOSPC) and a file-size limit the kernel enforces mid-run
(``RLIMIT_FSIZE``: EFBIG once the recording outgrows it)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import clean_env

pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "otel_gpu.cli"]
JOB = "import time; time.sleep(1.5); raise SystemExit(7)"


def _run(*outputs: str, job: str = JOB, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [*CLI, "run", "--exporter", "none", "--simulate", "leak", "--interval", "0.1",
         *outputs, "--", sys.executable, "-c", job],
        capture_output=True, text=True, timeout=90, env=clean_env(), **kwargs,
    )  # fmt: skip


def _lines_naming(text: str, what: str) -> list[str]:
    return [line for line in text.splitlines() if what in line]


def test_a_full_disk_under_record_keeps_the_jobs_code_and_the_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = _run("--record", "/dev/full", "--summary-json", str(summary))
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = _lines_naming(proc.stderr, "/dev/full")
    assert "--record /dev/full: recording stopped (No space left on device)" in line
    data = json.loads(summary.read_text())
    assert data["exit_code"] == 7 and data["gpus"]
    assert "exit code 7" in proc.stderr  # the summary is still shown


def test_a_full_disk_under_summary_json_keeps_the_jobs_code_and_the_recording(
    tmp_path: Path,
) -> None:
    record = tmp_path / "run.csv"
    proc = _run("--record", str(record), "--summary-json", "/dev/full")
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = _lines_naming(proc.stderr, "/dev/full")
    assert "--summary-json /dev/full: not written (No space left on device)" in line
    rows = record.read_text().splitlines()
    assert rows[0].startswith("subject,label,time_s") and len(rows) > 2
    # The report of that recording, to a full disk: one line, a failure, no traceback.
    report = subprocess.run(
        [*CLI, "report", str(record), "--output", "/dev/full"],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert report.returncode != 0 and "Traceback" not in report.stderr, report.stderr
    (line,) = report.stderr.strip().splitlines()
    assert "--output /dev/full: cannot write (No space left on device)" in line


def _limit_file_size() -> None:
    # A disk that fills up while the job runs: past 8 KiB every write of the recording
    # fails (EFBIG; Python ignores SIGXFSZ). The summary, ~1 KiB, still fits.
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))


def test_a_disk_that_fills_up_during_the_run(tmp_path: Path) -> None:
    record, summary = tmp_path / "run.csv", tmp_path / "summary.json"
    job = "import time; time.sleep(4); raise SystemExit(7)"
    proc = _run(
        "--record", str(record), "--summary-json", str(summary),
        job=job, preexec_fn=_limit_file_size,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = _lines_naming(proc.stderr, "recording")
    assert f"--record {record}: recording stopped (File too large)" in line
    assert 0 < record.stat().st_size <= 8192  # rows were written until the disk "filled"
    assert json.loads(summary.read_text())["exit_code"] == 7
