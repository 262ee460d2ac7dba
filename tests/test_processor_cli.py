"""`otel-gpu processor` as a real child process: CLI errors, kill -9 and restart, SIGTERM, rotel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from support.otlp_receiver import call, receiver
from support.paths import ROOT
from support.ports import free_port
from support.processor import ProcessorProcess, leak_requests, processor_cli
from support.webhook import Webhook

from otel_gpu.processor.wire import METRICS_EXPORT


@pytest.mark.process
@pytest.mark.parametrize(
    "args, variables, fragment",
    [
        (["--listen", "nonsense"], {}, "--listen='nonsense': use HOST:PORT with a port from 0"),
        (["--forward", "127.0.0.1"], {}, "--forward='127.0.0.1': use HOST:PORT, http://"),
        (["--listen", "127.0.0.1:99999"], {}, "--listen='127.0.0.1:99999': use HOST:PORT"),
        ([], {"OTEL_GPU_PROCESSOR_HEALTH": "x:y"}, "OTEL_GPU_PROCESSOR_HEALTH='x:y': use HOST"),
        (["--tls-cert", "README.md"], {}, "--tls-cert='README.md': a TLS certificate and its"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", "README.md"], {},
         "--tls-cert='/nonexistent.pem': no such file; give the path of a readable PEM file"),
        (["--state", "/nonexistent-dir/x.db"], {}, "cannot open it as a SQLite database"),
        (["--stall-after", "-1"], {}, "--stall-after='-1': use a positive number of seconds"),
        (["--max-series", "many"], {}, "--max-series='many': use a whole number, 1 or more"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_usage_errors(args, variables, fragment):
    r = processor_cli(*args, **variables)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in r.stderr


@pytest.mark.process
def test_a_port_in_use_is_a_usage_error():
    first = ProcessorProcess("--listen", "127.0.0.1:0")
    try:
        r = processor_cli("--listen", first.address)
        assert r.returncode == 2 and "cannot listen there" in r.stderr
    finally:
        first.terminate()


def _transitions(down) -> int:
    return sum(r.event_name == "otel_gpu.breaker.transition" for r in down.log_records())


@pytest.mark.peers
def test_kill_9_and_restart_keeps_the_open_breaker_and_does_not_notify_again(tmp_path):
    hook = Webhook()
    state = str(tmp_path / "processor.db")
    env = {
        "OTEL_GPU_WEBHOOK_URL": hook.url,
        "OTEL_GPU_BREAKER_COOLDOWN_S": "1000000",
        "OTEL_GPU_PROCESSOR_TOKEN": "sekret-token-1",
    }
    md = (("authorization", "Bearer sekret-token-1"),)
    t0 = time.time() - 12 * 3600
    with receiver() as down:
        args = ("--listen", "127.0.0.1:0", "--state", state, "--forward", down.address)
        args += ("--export-interval", "0.2")
        first = ProcessorProcess(*args, env=env)
        try:
            for raw in leak_requests(600, start_s=t0):
                call(first.address, METRICS_EXPORT, raw, metadata=md)
            deadline = time.monotonic() + 15
            while len(hook.bodies) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            # the GPU's and the process's breakers opened: one notification each
            assert len(hook.bodies) == 2, first.output
            assert all(json.loads(b)["to_state"] == "open" for b in hook.bodies)
            assert down.wait_for(lambda: _transitions(down) == 2)
        finally:
            first.kill()  # SIGKILL: no shutdown code runs
        alerts_before = len(down.alerts())
        transitions_before = _transitions(down)
        second = ProcessorProcess(*args, env=env)
        try:
            # the same job keeps leaking; the new engine instance finds it again
            for raw in leak_requests(600, start_s=t0, first=600):
                call(second.address, METRICS_EXPORT, raw, metadata=md)
            assert down.wait_for(lambda: len(down.alerts()) > alerts_before, timeout=15)
            assert down.wait_for(
                lambda: any(
                    p.as_int == 2 for p in down.metric_points("otel_gpu.breaker.state")[-2:]
                )
            )
            time.sleep(1.0)  # give a (wrong) notification time to arrive
            assert len(hook.bodies) == 2
            assert _transitions(down) == transitions_before  # no new open, no new episode
        finally:
            rc = second.terminate()
        assert rc == 0
        for out in (first.output, second.output):
            assert "sekret-token-1" not in out and "s3cr3t-path" not in out
    hook.close()


@pytest.mark.process
def test_sigterm_flushes_and_exits_promptly():
    with receiver() as down:
        p = ProcessorProcess("--listen", "127.0.0.1:0", "--forward", down.address)
        raws = list(leak_requests(3))
        for raw in raws:
            call(p.address, METRICS_EXPORT, raw)
        t0 = time.monotonic()
        rc = p.terminate()
        assert rc == 0 and time.monotonic() - t0 < 8
        assert b"".join(down.raw[METRICS_EXPORT]) == b"".join(raws)
        assert "stopping" in p.output


def _rotel() -> str:
    import rotel

    path = Path(rotel.__file__).parent / "rotel-agent"
    if not path.exists():
        pytest.fail(f"rotel is installed without its agent binary at {path}")
    return str(path)


@pytest.mark.peers
def test_sdk_through_rotel_through_the_processor(tmp_path):
    with receiver() as down:
        proc = ProcessorProcess("--listen", "127.0.0.1:0", "--forward", down.address)
        rotel_port = free_port()
        rotel = subprocess.Popen(
            [
                _rotel(),
                "start",
                "--otlp-grpc-endpoint", f"127.0.0.1:{rotel_port}",
                "--otlp-http-endpoint", f"127.0.0.1:{free_port()}",
                "--exporter", "otlp",
                "--otlp-exporter-endpoint", f"http://{proc.address}",
                "--otlp-exporter-protocol", "grpc",
                "--batch-timeout", "100ms",
                "--pid-file", str(tmp_path / "rotel.pid"),
                "--log-file", str(tmp_path / "rotel.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{rotel_port}", insecure=True)
            reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
            mp = MeterProvider(
                resource=Resource.create({"service.name": "via-rotel"}), metric_readers=[reader]
            )
            mp.get_meter("t").create_gauge("hw.power", unit="W").set(123.0, {"hw.id": "GPU-r"})
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not down.metric_points("hw.power"):
                mp.force_flush(5_000)  # the first flush may race rotel's start-up
                down.wait_for(lambda: bool(down.metric_points("hw.power")), timeout=1.0)
            points = down.metric_points("hw.power")
            assert points and points[0].as_double == 123.0
            mp.shutdown()
        finally:
            rotel.terminate()
            try:
                rotel.wait(10)
            except subprocess.TimeoutExpired:
                rotel.kill()
                rotel.wait(5)
            assert proc.terminate() == 0


@pytest.mark.process
def test_the_real_agent_payload_is_decoded_into_subjects():
    """`otel-gpu run --simulate` (the real agent and SDK exporter) -> processor -> receiver."""
    import re
    import urllib.request

    with receiver() as down:
        p = ProcessorProcess(
            "--listen", "127.0.0.1:0", "--forward", down.address, "--health", "127.0.0.1:0"
        )  # fmt: skip
        try:
            agent = subprocess.run(
                [
                    sys.executable, "-m", "otel_gpu.cli", "run", "--simulate", "steady",
                    "--endpoint", f"http://{p.address}", "--interval", "0.2",
                    "--export-interval", "0.5", "--",
                    sys.executable, "-c", "import time; time.sleep(2.5)",
                ],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            )  # fmt: skip
            assert agent.returncode == 0, agent.stderr
            health = re.search(r"health on (http://\S+)/healthz", p.output)
            assert health
            with urllib.request.urlopen(health.group(1) + "/stats", timeout=5) as r:
                stats = json.loads(r.read())
            det = stats["detection"]
            # one GPU, the job's process on it (GPU memory) and its host memory
            # the agent runs detection and says so (otel_gpu.breaker.state per subject): the
            # processor leaves those subjects to it rather than notify twice
            assert det["subjects"] >= 3 and det["agent_watched"] >= 3
            assert det["rejected"] == 0 and det["errors"] == 0
            assert down.metric_points("hw.gpu.memory.usage")
            assert down.metric_points("process.gpu.memory.usage")
        finally:
            assert p.terminate() == 0
