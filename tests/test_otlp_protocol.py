"""``OTEL_EXPORTER_OTLP_PROTOCOL`` (and ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``) is honoured
(issue 23.5): gRPC by default, HTTP/protobuf through the SDK's HTTP exporter when it is
installed (the ``otlp-http`` extra), and otherwise a one-line refusal that names the setting and
the package before the job starts, instead of gRPC spoken to an HTTP port ("Failed parsing
HTTP/2") for the whole run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import CLI, clean_env

from otel_gpu.core.errors import UsageError
from otel_gpu.core.otlp import otlp_protocol

HTTP_INSTALLED = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None


@pytest.mark.unit
def test_the_per_signal_variable_wins_and_grpc_is_the_default() -> None:
    assert otlp_protocol({}, "metrics") == "grpc"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert otlp_protocol(env, "metrics") == "http/protobuf"
    env["OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"] = " GRPC "
    assert otlp_protocol(env, "metrics") == "grpc"
    assert otlp_protocol(env, "traces") == "http/protobuf"
    with pytest.raises(UsageError, match=r"OTEL_EXPORTER_OTLP_LOGS_PROTOCOL='http/json': use grpc"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/json"}, "logs")


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / "ran"
    proc = subprocess.run(
        [*CLI, "run", "--simulate", "steady", "--exporter", "otlp", "--endpoint",
         "http://127.0.0.1:9", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        capture_output=True, text=True, timeout=60, env=clean_env(OTEL_GPU_DETECT="false", **env),
    )  # fmt: skip
    return proc, marker


@pytest.mark.process
def test_run_with_http_protobuf_uses_the_http_exporter_or_says_how_to_get_it(
    tmp_path: Path,
) -> None:
    proc, marker = _run(tmp_path, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    if HTTP_INSTALLED:
        assert proc.returncode == 0 and marker.exists(), proc.stderr[-2000:]
        assert "HTTP/2" not in proc.stderr  # never gRPC to an HTTP port
    else:
        assert proc.returncode == 2 and not marker.exists()  # refused before the job started
        assert proc.stderr.strip().splitlines() == [
            "otel-gpu: error: OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf: the OTLP/HTTP exporter "
            "is not installed; pip install '.[otlp-http]' from a clone "
            "(or pip install opentelemetry-exporter-otlp-proto-http), or use grpc"
        ]


@pytest.mark.process
def test_run_refuses_a_protocol_without_an_exporter(tmp_path: Path) -> None:
    proc, marker = _run(tmp_path, OTEL_EXPORTER_OTLP_METRICS_PROTOCOL="http/json")
    assert proc.returncode == 2 and not marker.exists()
    assert proc.stderr.strip().splitlines() == [
        "otel-gpu: error: OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='http/json': use grpc or "
        "http/protobuf (http/json has no exporter)"
    ]
