"""`otel-gpu doctor`: a real OTLP handshake, the PID-namespace check without NVML, --json."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.cli import clean_env, otel_gpu
from support.otlp_sink import OtlpSink

pytestmark = pytest.mark.process


@contextmanager
def plain_http() -> Iterator[str]:
    """An HTTP/1.1 server on 127.0.0.1: accepts TCP, speaks no gRPC."""

    class Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def otlp_server() -> Iterator[str]:
    with OtlpSink() as sink:
        yield sink.endpoint


@contextmanager
def closed_port() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


def _doctor_json(endpoint: str) -> tuple[int, dict[str, dict]]:
    res = otel_gpu(
        "doctor", "--simulate", "steady", "--endpoint", endpoint, "--json", env=clean_env()
    )
    doc = json.loads(res.stdout)
    assert doc["ok"] == (res.returncode == 0)
    return res.returncode, {c["name"]: c for c in doc["checks"]}


def test_the_exporter_check_does_a_real_otlp_handshake() -> None:
    cases = [
        (otlp_server, "ok", "OTLP ok"),
        (plain_http, "fail", "not an OTLP gRPC server"),
        (closed_port, "fail", "refused"),
    ]
    for server, status, detail in cases:
        with server() as endpoint:
            code, checks = _doctor_json(endpoint)
        exporter = checks["exporter"]
        assert (exporter["status"], detail in exporter["detail"]) == (status, True), exporter
        assert endpoint.removeprefix("http://") in exporter["detail"]
        if status == "fail":
            assert code == 1 and "OTEL_EXPORTER_OTLP_ENDPOINT" in exporter["fix"]


def test_the_pid_namespace_is_checked_even_without_nvml(tmp_path) -> None:
    """No libnvidia-ml.so.1 here: the nvml check fails, and the namespace check still runs."""
    with otlp_server() as endpoint:
        res = otel_gpu(
            "doctor", "--endpoint", endpoint, "--json", env=clean_env(LD_LIBRARY_PATH=str(tmp_path))
        )
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["nvml"]["status"] == "fail"
    assert checks["pid namespace"]["status"] in ("ok", "warn")
    assert "PID namespace" in checks["pid namespace"]["detail"]


def test_plain_output_is_one_line_per_check() -> None:
    with otlp_server() as endpoint:
        res = otel_gpu("doctor", "--simulate", "steady", "--endpoint", endpoint, env=clean_env())
    lines = res.stdout.strip().splitlines()
    assert any(line.startswith("ok    exporter: ") and "OTLP ok" in line for line in lines)
    assert all(line.split()[0] in ("ok", "warn", "fail") for line in lines)
