"""Sharp edges a new user hits, through the real `otel-gpu` entry point (issues 9 §4, 12 §4)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import CLI, GRPC_CORE_LINE, clean_env, otel_gpu
from support.otlp_sink import OtlpSink

from otel_gpu import __version__

ROOT = str(Path(__file__).resolve().parents[1])


def _one_line_usage_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert needle in lines[0], lines[0]


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.process
def test_version_prints_the_package_version() -> None:
    res = otel_gpu("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"otel-gpu {__version__}"


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        # The flag the user typed, not the variable it stands in for.
        (
            ["run", "--export-interval", "0", "--", "true"],
            "--export-interval='0': use a positive number of seconds",
        ),
        (["run", "--endpoint", "localhost:99999", "--", "true"], "port 99999 is out of range"),
        (["run", "--endpoint", "localhost:0", "--", "true"], "port 0 is out of range"),
        # Unknown options point at the subcommand's help, which lists its options.
        (["run", "--bogus", "--", "true"], "(see 'otel-gpu run --help')"),
        (["watch", "--pid", "123", "--bogus"], "(see 'otel-gpu watch --help')"),
        (["--bogus"], "(see 'otel-gpu --help')"),
        # PID 1's tree is every process of the host.
        (["watch", "--pid", "1"], "--pid 1 is init"),
    ],
)
def test_flag_mistakes_name_the_flag(args: list[str], needle: str) -> None:
    _one_line_usage_error(otel_gpu(*args), needle)


@pytest.mark.process
def test_run_says_why_a_program_cannot_run(tmp_path: Path) -> None:
    plain = tmp_path / "README.md"
    plain.write_text("# not a program\n")
    cases = [
        ([str(plain)], "is not executable: chmod +x it"),
        ([str(tmp_path)], "is a directory, not a command"),
        ([str(tmp_path / "missing")], "command not found"),
    ]
    for command, needle in cases:
        _one_line_usage_error(otel_gpu("run", "--", *command), needle)
    # A bare name of a file in the current directory: exec would not look there.
    res = subprocess.run(
        [*CLI, "run", "--", "README.md"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(PYTHONPATH=ROOT),
        cwd=tmp_path,
    )
    _one_line_usage_error(res, "give its path: ./README.md")


@pytest.mark.process
@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("OTEL_EXPORTER_OTLP_INSECURE", "maybe", "OTEL_EXPORTER_OTLP_INSECURE='maybe': use true"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", "no such file"),
        ("OTEL_GPU_PROC_ROOT", "/nonexistent", "OTEL_GPU_PROC_ROOT=/nonexistent: no process table"),
        ("OTEL_GPU_NVML_LIBRARY", "libnvidia-ml.so.1", "is a relative path"),
        ("OTEL_GPU_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1", "no such file"),
    ],
)
def test_bad_settings_refuse_before_the_job_starts(
    tmp_path: Path, variable: str, value: str, needle: str
) -> None:
    marker = tmp_path / "job-ran"
    job = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    res = otel_gpu("run", "--simulate", "steady", "--", *job, env=clean_env(**{variable: value}))
    _one_line_usage_error(res, needle)
    assert variable in res.stderr
    assert not marker.exists()


@pytest.mark.process
def test_no_collector_is_reported_once_per_episode_and_grpc_core_stays_quiet() -> None:
    """A closed port: the SDK alone prints two long lines per export (8 here) and gRPC's C core
    its own; otel-gpu says it once, with the cause."""
    port = _closed_port()
    res = otel_gpu(
        "run", "--simulate", "steady", "--endpoint", f"http://127.0.0.1:{port}",
        "--interval", "0.2", "--export-interval", "0.5", "--no-detect",
        "--", sys.executable, "-c", "import time; time.sleep(4)",
        env=clean_env(OTEL_GPU_SHUTDOWN_TIMEOUT="2", OTEL_EXPORTER_OTLP_TIMEOUT="1"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    export_lines = [line for line in res.stderr.splitlines() if "export" in line.lower()]
    assert len(export_lines) == 1, res.stderr
    assert f"metric export to http://127.0.0.1:{port} failed: UNAVAILABLE" in export_lines[0]
    assert "Transient error" not in res.stderr and "Failed to export" not in res.stderr
    assert not GRPC_CORE_LINE.search(res.stderr), res.stderr
    assert "can only be called once" not in res.stderr


@pytest.mark.process
def test_the_job_gets_the_users_environment_without_otel_gpus_grpc_setting() -> None:
    show = "import os; print(os.environ.get('GRPC_VERBOSITY'))"
    for env, expected in ((clean_env(), "None"), (clean_env(GRPC_VERBOSITY="DEBUG"), "DEBUG")):
        res = otel_gpu("run", "--exporter", "none", "--no-detect", "--", sys.executable, "-c",
                       show, env=env)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().splitlines()[-1] == expected


@pytest.mark.process
def test_without_a_gpu_the_nvml_warning_appears_once(tmp_path: Path) -> None:
    """The resource detector and the agent both open NVML; one machine without a GPU is one
    line. (No libnvidia-ml.so.1 is on this machine's library path.)"""
    res = otel_gpu(
        "run", "--exporter", "none", "--no-detect", "--interval", "0.2", "--", sys.executable,
        "-c", "import time; time.sleep(1.5)",
        env=clean_env(LD_LIBRARY_PATH=str(tmp_path)),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "no GPU data" in warnings[0], res.stderr


@pytest.mark.process
def test_a_short_instrumented_job_logs_no_shutdown_meter_provider_warning(tmp_path: Path) -> None:
    """The in-process agent is still being built when a short job exits: the meter provider
    must not be shut down under it ("A shutdown MeterProvider can not provide a Meter")."""
    instrument = Path(sys.executable).with_name("opentelemetry-instrument")
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_GPU_LOCK_DIR=str(tmp_path),
        PYTHONPATH=ROOT,
    )
    res = subprocess.run(
        [str(instrument), sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "can not provide a" not in res.stderr, res.stderr


@pytest.mark.process
def test_ctrl_c_during_the_demo_stops_cleanly_with_130() -> None:
    proc = subprocess.Popen(
        [*CLI, "demo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert "windows shortened" in lines[1], lines
        # Running: past start-up, the view (plain lines on a pipe) showing status on stderr.
        while "up 00:" not in (status := proc.stderr.readline()):
            assert status, "the demo ended before showing its status"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Traceback" not in out
    assert "no alert was raised" not in out
    assert "stopped (Ctrl-C)" in out


@pytest.mark.process
def test_report_without_matplotlib_says_how_to_install_it_from_a_clone(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['matplotlib'] = None; from otel_gpu.cli import main; "
    res = subprocess.run(
        [sys.executable, "-c", blocked + f"sys.exit(main(['report', '{tmp_path / 'run.csv'}']))"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    _one_line_usage_error(
        res,
        "otel-gpu: error: otel-gpu report needs matplotlib: pip install '.[report]' from a clone "
        "(or pip install matplotlib)",
    )


@pytest.mark.process
def test_the_demo_says_its_windows_are_shortened() -> None:
    res = otel_gpu("demo", "--scenario", "steady", "--max-seconds", "2")
    assert res.returncode == 0, res.stderr
    assert "windows shortened for the demo" in res.stdout
    assert "~2 h of data for a slow leak" in res.stdout


@pytest.mark.peers
def test_verbose_logs_what_the_agent_does() -> None:
    with OtlpSink() as sink:
        argv = [*CLI, "run", "--quiet", "--simulate", "leak", "--interval", "0.3",
                "--export-interval", "0.5", "--endpoint", sink.endpoint, "--",
                sys.executable, "-c", "import time; time.sleep(2)"]  # fmt: skip
        quiet = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env())
        loud = subprocess.run(
            [*argv[:4], "-v", *argv[4:]],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
    assert quiet.returncode == loud.returncode == 0, loud.stderr
    assert "INFO" not in quiet.stderr
    assert "sampling helper process started (PID" in loud.stderr
    assert "first sweep: 1 GPU(s), " in loud.stderr
    assert f"metric export to {sink.endpoint}: first export delivered" in loud.stderr


@pytest.mark.peers
def test_endpoint_credentials_never_reach_the_log() -> None:
    port = _closed_port()
    res = otel_gpu(
        "run", "-v", "--quiet", "--simulate", "steady", "--export-interval", "0.5",
        "--endpoint", f"http://agent:s3cr3t-t0ken@127.0.0.1:{port}", "--",
        sys.executable, "-c", "import time; time.sleep(1.5)", env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"metric export to http://127.0.0.1:{port} failed" in res.stderr
    assert "s3cr3t" not in res.stderr
