"""`--exporter` takes a comma list; the Prometheus endpoint honours the standard variables, and
mistakes in either are one line naming the setting, exit code 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from support.ports import free_port

from otel_gpu.agent.export import metric_readers
from otel_gpu.agent.settings import Settings
from otel_gpu.core.errors import UsageError
from otel_gpu.core.prometheus import ScrapeEndpoint


@pytest.mark.unit
@pytest.mark.parametrize(
    ("given", "exporters"),
    [
        ("otlp", ("otlp",)),
        ("prometheus", ("prometheus",)),
        ("otlp,prometheus", ("otlp", "prometheus")),
        (" Prometheus , console ", ("prometheus", "console")),
        ("otlp,otlp", ("otlp",)),
        ("none", ()),
    ],
)
def test_exporter_lists(given: str, exporters: tuple[str, ...]) -> None:
    assert Settings.load({}, exporter=given).exporters == exporters
    assert Settings.load({"OTEL_METRICS_EXPORTER": given}).exporters == exporters


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "explicit", "needle"),
    [
        ({}, "otlp,zipkin", "--exporter='otlp,zipkin': unknown exporter 'zipkin'"),
        ({"OTEL_METRICS_EXPORTER": "prom"}, None, "OTEL_METRICS_EXPORTER='prom': unknown"),
        ({}, "none,otlp", "or none alone"),
        ({}, ",", "or none alone"),
    ],
)
def test_bad_exporter_lists_name_the_setting(env, explicit, needle) -> None:
    with pytest.raises(UsageError) as err:
        Settings.load(env, exporter=explicit)
    assert needle in str(err.value)


@pytest.mark.process
def test_the_endpoint_defaults_to_localhost_9464_and_serves_metrics() -> None:
    try:
        endpoint = ScrapeEndpoint.from_env({})
    except UsageError as exc:  # another test run on this machine holds the default port
        assert "9464" in str(exc)
        return
    try:
        assert endpoint.address == ("localhost", 9464)
        with urllib.request.urlopen("http://localhost:9464/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        endpoint.shutdown()


@pytest.mark.process
def test_the_endpoint_stops_serving_at_shutdown() -> None:
    port = free_port()
    reader = metric_readers(
        Settings(exporter="prometheus"),
        {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)},
    )[0]
    assert isinstance(reader, ScrapeEndpoint) and reader.address == ("127.0.0.1", port)
    reader.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.process
@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"OTEL_EXPORTER_PROMETHEUS_PORT": "http"},
            "OTEL_EXPORTER_PROMETHEUS_PORT='http' is not a TCP port",
        ),
        ({"OTEL_EXPORTER_PROMETHEUS_PORT": "70000"}, "use 1-65535 (default 9464)"),
        (
            {"OTEL_EXPORTER_PROMETHEUS_HOST": "no-such-host.invalid"},
            "OTEL_EXPORTER_PROMETHEUS_HOST",
        ),
    ],
)
def test_bad_endpoint_settings_are_usage_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(UsageError) as err:
        ScrapeEndpoint.from_env({"OTEL_EXPORTER_PROMETHEUS_PORT": str(free_port()), **env})
    assert needle in str(err.value)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    return subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


@pytest.mark.process
def test_a_taken_port_refuses_to_start_the_job(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        marker = tmp_path / "ran"
        res = _cli(
            "run", "--exporter", "prometheus", "--simulate", "steady", "--",
            sys.executable, "-c", f"open({str(marker)!r}, 'w')",
            OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
            OTEL_GPU_LOCK_DIR=str(tmp_path),
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{port}" in res.stderr
    assert "choose a free port with OTEL_EXPORTER_PROMETHEUS_PORT" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not marker.exists()


@pytest.mark.process
def test_a_bad_exporter_flag_is_one_line_exit_2() -> None:
    res = _cli("run", "--exporter", "otlp,statsd", "--", "true")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "otel-gpu: error: --exporter='otlp,statsd': unknown exporter 'statsd'; use one or more "
        "of otlp, console, prometheus (comma-separated), or none"
    )


@pytest.mark.process
def test_watch_serves_the_attached_jobs_metrics(tmp_path) -> None:
    port = free_port()
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    watcher = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "watch", "--pid", str(job.pid),
         "--simulate", "steady", "--interval", "0.2", "--exporter", "prometheus"],
        env={**clean, "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
             "OTEL_EXPORTER_PROMETHEUS_PORT": str(port), "OTEL_GPU_LOCK_DIR": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        body = b""
        while f'process_pid="{job.pid}"'.encode() not in body:
            assert time.monotonic() < deadline, body[-2000:]
            time.sleep(0.3)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read()
            except OSError:
                continue
        assert b"hw_gpu_memory_usage_bytes{" in body and b"process_memory_usage_bytes{" in body
    finally:
        job.kill()
        job.wait(5)
        try:
            assert watcher.wait(20) == 0  # the watched PID is gone: watch ends by itself
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait(5)


@pytest.mark.peers
def test_idle_connections_do_not_pile_up_threads_and_scrapes_resume() -> None:
    """prometheus_client's own server gave each of these a thread, held for ever."""
    import threading

    from opentelemetry.sdk.metrics import MeterProvider

    from otel_gpu.core.prometheus import SCRAPE_WORKERS

    endpoint = ScrapeEndpoint("127.0.0.1", 0)
    provider = MeterProvider(metric_readers=[endpoint], shutdown_on_exit=False)
    provider.get_meter("t").create_counter("probe").add(1)
    url = f"http://127.0.0.1:{endpoint.address[1]}/metrics"
    before = threading.active_count()
    idle = [socket.create_connection(endpoint.address) for _ in range(100)]
    try:
        for s in idle:
            s.sendall(b"GET /metr")  # and nothing more
        time.sleep(0.5)
        assert threading.active_count() <= before + SCRAPE_WORKERS
        deadline = time.monotonic() + 30  # the idle ones are dropped after their timeout
        while True:
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape answered after the idle ones"
                time.sleep(0.5)
        assert re.search(r"^probe_total\{.*\} 1.0$", body, re.M), body
    finally:
        for s in idle:
            s.close()
        provider.shutdown()
