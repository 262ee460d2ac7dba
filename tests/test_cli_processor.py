"""`otel-gpu processor` edges: the real bind error, the shared log format, honest durations."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import GRPC_CORE_LINE
from support.otlp_receiver import call
from support.paths import ROOT
from support.ports import free_port
from support.processor import ProcessorProcess, leak_requests

from otel_gpu.processor.wire import METRICS_EXPORT

pytestmark = pytest.mark.process


def processor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    return subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "processor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**base, **env},
    )


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and not GRPC_CORE_LINE.search(res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_an_address_not_on_this_host_is_named_as_such() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never a local address; binding sends no traffic.
    line = _one_line(processor("--listen", f"192.0.2.1:{free_port()}"))
    assert "cannot assign requested address" in line
    assert "port in use" not in line


def test_grpc_core_logs_only_when_the_user_asks_with_grpc_verbosity() -> None:
    res = processor("--listen", f"192.0.2.1:{free_port()}", GRPC_VERBOSITY="ERROR")
    assert res.returncode == 2
    assert GRPC_CORE_LINE.search(res.stderr), res.stderr


def test_a_port_in_use_is_named_as_such() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        line = _one_line(processor("--listen", f"127.0.0.1:{holder.getsockname()[1]}"))
    assert "address already in use" in line


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--listen", "{held}"], {},
         "--listen='{held}': cannot listen there (address already in use"),
        ([], {"OTEL_GPU_PROCESSOR_LISTEN": "{held}"},
         "OTEL_GPU_PROCESSOR_LISTEN='{held}': cannot listen there (address already in use"),
        (["--listen", "127.0.0.1:0", "--health", "{held}"], {},
         "--health='{held}': cannot listen there"),
        (["--listen", "127.0.0.1:0"], {"OTEL_GPU_PROCESSOR_HEALTH": "{held}"},
         "OTEL_GPU_PROCESSOR_HEALTH='{held}': cannot listen there"),
        (["--listen", "127.0.0.1:0"], {"OTEL_GPU_PROCESSOR_STATE": "{dir}"},
         "OTEL_GPU_PROCESSOR_STATE='{dir}': cannot open it as a SQLite database"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:9"],
         {"OTEL_GPU_PROCESSOR_QUEUE_DIR": "/dev/null/q"},
         "OTEL_GPU_PROCESSOR_QUEUE_DIR='/dev/null/q': cannot keep a queue there"),
    ],
)  # fmt: skip
def test_a_problem_found_at_start_names_the_flag_or_variable_used(
    args: list[str], env: dict[str, str], message: str, tmp_path: Path
) -> None:
    """Not only bad values: a port in use or a path that cannot hold the state is reported
    by the setting the user actually set."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        fill = {"held": f"127.0.0.1:{holder.getsockname()[1]}", "dir": str(tmp_path)}
        argv = [a.format(**fill) for a in args]
        line = _one_line(processor(*argv, **{k: v.format(**fill) for k, v in env.items()}))
    assert line.startswith("otel-gpu: error: " + message.format(**fill)), line


def test_logs_share_the_cli_format_and_a_failed_forward_reports_its_real_duration() -> None:
    """A downstream that refuses: the drop at shutdown says how long it failed (about a
    second here), not the 60 s retry budget."""
    p = ProcessorProcess("--listen", "127.0.0.1:0", "--forward", f"127.0.0.1:{free_port()}",
                         "--flush-timeout", "1")  # fmt: skip
    try:
        call(p.address, METRICS_EXPORT, next(leak_requests(1)))
        time.sleep(1.0)
    finally:
        assert p.terminate() == 0
    logged = [line for line in p.lines if not line.startswith("otel-gpu processor: ")]
    assert logged, p.output
    assert all(re.match(r"otel-gpu: [A-Z]+ [\w.]+: ", line) for line in logged), p.output
    failed = [line for line in logged if "failed" in line and "dropped one request" in line]
    assert len(failed) == 1, p.output
    seconds = int(re.search(r"for (\d+) s", failed[0]).group(1))  # type: ignore[union-attr]
    assert seconds < 10, failed[0]
