"""The `otel-gpu` command line as a user runs it: real processes, real exporters."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import CLI, clean_env, otel_gpu
from support.console import console_points_by_name

pytestmark = pytest.mark.process


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["run"], "no command to run: put it after '--'"),
        (["run", "--"], "no command to run"),
        (["run", "--", "no-such-program-xyz"], "command not found: 'no-such-program-xyz'"),
        (["run", "--endpoint", "http://host:port", "--", "true"], "bad OTLP endpoint"),
        (["run", "--simulate", "melt", "--", "true"], "unknown simulation scenario 'melt'"),
        (["run", "--interval", "0", "--", "true"], "0.1 s or more"),
        (["watch", "--pid", "999999999"], "no process with PID 999999999"),
        (["watch"], "the following arguments are required: --pid"),
        (["watch", "--pid", "abc"], "invalid int value: 'abc'"),
    ],
)
def test_user_mistakes_get_one_line_and_exit_2(args: list[str], needle: str) -> None:
    res = otel_gpu(*args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_help_explains_every_option() -> None:
    res = otel_gpu("run", "--help")
    assert res.returncode == 0
    for option in ("--interval", "--exporter", "--endpoint", "--simulate", "--no-detect"):
        assert option in res.stdout


def test_run_passes_the_exit_code_through() -> None:
    res = otel_gpu(
        "run", "--exporter", "none", "--no-detect", "--", sys.executable, "-c", "exit(7)"
    )
    assert res.returncode == 7, res.stderr


def test_run_with_simulated_gpu_prints_device_and_process_points() -> None:
    code = "import time; time.sleep(3)"
    res = otel_gpu(
        "run", "--simulate", "leak", "--exporter", "console", "--interval", "0.2",
        "--export-interval", "1", "--no-detect", "--", sys.executable, "-c", code,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    pts = console_points_by_name(res.stdout)
    assert pts["hw.gpu.memory.usage"] and pts["hw.gpu.utilization"] and pts["hw.power"]
    child_pids = {p["attributes"]["process.pid"] for p in pts["process.gpu.memory.usage"]}
    assert len(child_pids) == 1
    rss_pids = {p["attributes"]["process.pid"] for p in pts["process.memory.usage"]}
    assert child_pids <= rss_pids
    # The resource carries git provenance (the tests run in this repository) and the GPU host.
    assert '"vcs.ref.head.revision"' in res.stdout
    assert '"otel_gpu.gpu.models": [' in res.stdout


def test_run_forwards_sigterm_and_reports_the_jobs_exit(tmp_path: Path) -> None:
    marker = tmp_path / "got-term"
    code = (
        "import signal, sys, time, pathlib\n"
        f"def h(*_): pathlib.Path({str(marker)!r}).write_text('x'); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, h)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen(
        [*CLI, "run", "--exporter", "none", "--no-detect", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 3
    assert marker.exists()


def test_run_reports_death_by_signal_as_128_plus_n() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    res = otel_gpu("run", "--exporter", "none", "--no-detect", "--", sys.executable, "-c", code)
    assert res.returncode == 128 + 9


def test_shutdown_is_bounded_when_the_collector_never_answers() -> None:
    """A collector that accepts connections and never replies: with a 30 s export timeout the
    SDK alone would wait out its retries; OTEL_GPU_SHUTDOWN_TIMEOUT bounds the whole exit."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts (the kernel completes handshakes) but never reads or answers
    try:
        began = time.monotonic()
        res = otel_gpu(
            "run", "--simulate", "steady", "--endpoint", f"http://127.0.0.1:{silent.getsockname()[1]}",
            "--interval", "0.2", "--export-interval", "0.5", "--no-detect",
            "--", sys.executable, "-c", "import time; time.sleep(1.5)",
            env=clean_env(OTEL_GPU_SHUTDOWN_TIMEOUT="2", OTEL_EXPORTER_OTLP_TIMEOUT="30"),
        )  # fmt: skip
        elapsed = time.monotonic() - began
    finally:
        silent.close()
    assert res.returncode == 0, res.stderr
    # 1.5 s of job + start-up + the 2 s bound; unbounded, the final export alone waits 30 s.
    assert elapsed < 12, elapsed


def test_run_forwards_signals_to_the_jobs_whole_process_group(tmp_path: Path) -> None:
    """A launcher that ignores SIGTERM (as `swift` would orphan its trainer) and its child
    that traps it: the child gets the signal too, as a terminal's Ctrl-C would deliver it."""
    marker = tmp_path / "grandchild-got-term"
    grandchild = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(marker)!r}).write_text('x'), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    launcher = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "sys.exit(p.wait())\n"
    )
    proc = subprocess.Popen(
        [*CLI, "run", "--exporter", "none", "--no-detect", "--", sys.executable, "-c", launcher],
        stdout=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert marker.exists()


def test_watch_attaches_and_stops_when_the_process_exits() -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5)"])
    try:
        res = otel_gpu(
            "watch", "--pid", str(job.pid), "--simulate", "steady", "--exporter", "console",
            "--interval", "0.2", "--export-interval", "0.5", "--no-detect", timeout=30,
        )  # fmt: skip
    finally:
        job.kill()
        job.wait()
    assert res.returncode == 0, res.stderr
    pts = console_points_by_name(res.stdout)
    assert {p["attributes"]["process.pid"] for p in pts["process.memory.usage"]} == {job.pid}
