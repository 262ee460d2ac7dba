"""`otel-gpu analyze` on files as users produce them: stdin, spreadsheet exports, renamed columns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.traces import DEV_TRACES

pytestmark = pytest.mark.process

STALL = DEV_TRACES / "stall_lowutil_0.csv"


def analyze(*args: str, stdin: bytes | None = None) -> tuple[int, list[dict], str]:
    res = subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "analyze", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
    )
    out = res.stdout.decode()
    return res.returncode, [json.loads(line) for line in out.splitlines()], res.stderr.decode()


def _kinds(alerts: list[dict]) -> list[tuple[str, float]]:
    return [(a["kind"], a["time_s"]) for a in alerts]


def test_dash_reads_standard_input() -> None:
    code, from_file, _ = analyze(str(STALL))
    assert code == 0 and from_file and from_file[0]["kind"] == "stall"
    code, from_stdin, err = analyze("-", stdin=STALL.read_bytes())
    assert code == 0, err
    assert _kinds(from_stdin) == _kinds(from_file)
    assert {a["file"] for a in from_stdin} == {"-"}


def test_a_byte_order_mark_and_crlf_line_ends_are_accepted(tmp_path: Path) -> None:
    """What a spreadsheet program saves: UTF-8 with a BOM, CRLF line ends."""
    text = STALL.read_text()
    exported = tmp_path / "exported.csv"
    exported.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    _, reference, _ = analyze(str(STALL))
    for args, stdin in (([str(exported)], None), (["-"], exported.read_bytes())):
        code, alerts, err = analyze(*args, stdin=stdin)
        assert code == 0, err
        assert "header lacks" not in err
        assert _kinds(alerts) == _kinds(reference)


def test_unknown_columns_are_warned_about_once(tmp_path: Path) -> None:
    """A `utilization` column is not `util`: its values are not read, and the user is told."""
    lines = STALL.read_text().splitlines()
    renamed = tmp_path / "renamed.csv"
    renamed.write_text("\n".join([lines[0].replace(",util,", ",utilization,"), *lines[1:]]) + "\n")
    code, _, err = analyze(str(renamed), str(renamed))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "utilization" in line]
    assert len(warnings) == 1, err
    assert "ignoring column(s) utilization" in warnings[0] and "util," in warnings[0]


def test_a_python_script_is_said_to_be_no_csv_first_and_only(tmp_path: Path) -> None:
    # Issue 19.8: `analyze train.py` warned about "ignoring column(s) import time" first.
    script = tmp_path / "train.py"
    script.write_text("import time, otel_gpu\nprint('hi')\n")
    code, alerts, err = analyze(str(script))
    assert code == 2 and alerts == []
    lines = err.splitlines()
    assert lines[0].startswith(f"otel-gpu: error: {script} is not a CSV trace or recording: ")
    assert "ignoring column" not in err


def test_each_file_gets_a_one_line_summary_on_stderr(tmp_path: Path) -> None:
    head = tmp_path / "short.csv"
    head.write_text("time_s,used_bytes,limit_bytes\n0,1,10\n7200,2,10\n")
    code, alerts, err = analyze(str(STALL), str(head))
    assert code == 0, err
    n_stall = len(STALL.read_text().strip().splitlines()) - 1
    summaries = [line for line in err.splitlines() if " samples, " in line]
    assert len(summaries) == 2, err
    assert summaries[0].startswith(f"otel-gpu: {STALL}: {n_stall} samples, ")
    assert summaries[0].endswith(f"{len(alerts)} alert" + ("s" if len(alerts) != 1 else ""))
    assert summaries[1] == f"otel-gpu: {head}: 2 samples, 0..7200 s (2.00 h), 0 alerts"


def test_a_file_is_streamed_alerts_come_before_its_end() -> None:
    """A trace on a pipe that stays open: the alert is printed while the file is still being
    read, so analyze holds one row at a time, not the whole file (10 M rows once took 4.2 GB;
    benchmarks/bench_analyze_memory.py measures it flat)."""
    import select
    import time

    lines = STALL.read_text().splitlines(keepends=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "analyze", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("".join(lines).encode())
        proc.stdin.flush()  # every row is written; the file has not ended
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no alert before the end of the file"
        alert = json.loads(proc.stdout.readline())
        assert alert["kind"] == "stall" and proc.poll() is None
        time.sleep(0.2)
        proc.stdin.write(lines[-1].encode())  # the file goes on after the alert
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
