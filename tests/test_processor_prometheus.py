"""`otel-gpu processor --prometheus HOST:PORT`: the processor's detector metrics and its own
telemetry on a Prometheus /metrics endpoint (the OpenTelemetry Prometheus exporter).

A real Prometheus 2.42 loaded with deploy/prometheus/ rules scrapes a real processor (a child
process) that receives a replayed leak over OTLP gRPC: the leak rules fire on the processor's
output with the subject's and the reporter's labels. The endpoint drops a series the processor
stopped sending, and a taken port is one line and exit 2 before anything is served.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.otlp_receiver import call
from support.paths import ROOT
from support.ports import free_port
from support.processor import leak_requests
from support.prometheus_peer import Prometheus, fill_grafana_macros, processor_scrape_config

from otel_gpu.core.errors import UsageError
from otel_gpu.processor import outputs
from otel_gpu.processor.scrape import DETECTOR, ProcessorScrape
from otel_gpu.processor.wire import METRICS_EXPORT


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    env["PYTHONPATH"] = str(ROOT)
    env["OTEL_GPU_BREAKER_COOLDOWN_S"] = "1000000"  # the breaker stays open for the test
    return env


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the processor exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on 127.0.0.1:{port}")


class Stack:
    def __init__(self, prom: Prometheus, scrape_port: int, log: Path) -> None:
        self.prom, self.scrape_port, self.log = prom, scrape_port, log


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("processor-prometheus")
    listen, scrape = free_port(), free_port()
    log = tmp / "processor.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "processor", "--listen", f"127.0.0.1:{listen}",
         "--prometheus", f"127.0.0.1:{scrape}", "--export-interval", "1",
         "--telemetry-interval", "1"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=open(log, "wb"),  # noqa: SIM115
    )  # fmt: skip
    config = processor_scrape_config(f"127.0.0.1:{scrape}")
    try:
        _wait_port(listen, proc)
        with Prometheus(tmp / "prometheus", config) as prom:
            # Twelve hours ago, one point each 15 s for 2.5 h: a process leaking 1.33 MB/s.
            for raw in leak_requests(600, start_s=time.time() - 12 * 3600):
                call(f"127.0.0.1:{listen}", METRICS_EXPORT, raw)
            yield Stack(prom, scrape, log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.peers
def test_the_leak_rules_fire_in_prometheus_on_the_processors_output(stack: Stack) -> None:
    firing = stack.prom.wait_for('ALERTS{alertname="GpuMemoryLeak",alertstate="firing"}', 60)
    assert firing, f"no leak alert: {stack.prom.api('alerts')}\n{stack.log.read_text()}"
    subjects = {a["metric"]["otel_gpu_subject"] for a in firing}
    # One problem, one firing alert per rule (issue 19.6): the process is the cause, its GPU
    # (leaking with it, in the processor's output too) is context.
    assert {s.split(":")[0] for s in subjects} == {"process"}, subjects
    # The replayed agent's resource identity rides along as labels.
    assert {a["metric"]["service_name"] for a in firing} == {"trainer"}
    assert {a["metric"]["service_instance_id"] for a in firing} == {"run-1"}
    process = next(a["metric"] for a in firing)
    assert process["process_pid"] == "10000" and process["hw_id"].startswith("GPU-")
    # The GPU's series carries no process_pid: the reporter's own pid is not a subject label.
    gpus = stack.prom.query('otel_gpu_leak_rate_bytes_per_second{otel_gpu_subject_kind="gpu"}')
    assert gpus, "the GPU's leak is in the output (the rule leaves it out, not the processor)"
    gpu = gpus[0]["metric"]
    assert "process_pid" not in gpu and gpu["host_name"] == "node-1"
    opened = stack.prom.wait_for('ALERTS{alertname="GpuBreakerOpen",alertstate="firing"}', 10)
    assert {a["metric"]["otel_gpu_subject"] for a in opened} == subjects
    counted = stack.prom.query('otel_gpu_alerts_total{otel_gpu_alert_kind="leak"}')
    assert {s["metric"]["otel_gpu_subject"] for s in counted} == subjects | {
        gpu["otel_gpu_subject"]
    }
    # 1.33 MB/s with about 11 h left: not "exhausted within the hour"; no hardware trouble.
    quiet = stack.prom.query(
        'ALERTS{alertname=~"GpuMemoryExhaustionSoon|GpuNotHealthy|GpuResetXid|GpuUncorrectedErrors"}'
    )
    assert quiet == []
    rate = stack.prom.query("otel_gpu_leak_rate_bytes_per_second")
    assert {round(float(s["value"][1]) / 1e6, 2) for s in rate} == {1.33}
    eta = stack.prom.query("otel_gpu_memory_time_to_exhaustion_seconds")
    assert all(3600 < float(s["value"][1]) < 86400 for s in eta), eta


@pytest.mark.peers
def test_prometheus_scrapes_the_processors_own_telemetry(stack: Stack) -> None:
    accepted = stack.prom.wait_for(
        'otel_gpu_processor_requests_accepted_total{signal="metrics"} >= 600', 30
    )
    assert accepted, stack.prom.query("otel_gpu_processor_requests_accepted_total")
    assert stack.prom.query("otel_gpu_processor_memory_usage_bytes > 0")
    info = stack.prom.query(f'target_info{{instance="127.0.0.1:{stack.scrape_port}"}}')
    assert info and info[0]["metric"]["service_name"] == "otel-gpu-processor"


def _detector_panels() -> list[tuple[str, str]]:
    """(title, expr) of the Fleet dashboard's panels on the detector metrics, its job variable
    at "All" (the dashboard's default)."""
    board = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "otel-gpu-fleet.json").read_text()
    )
    every = {
        f"${v['name']}": v["allValue"] for v in board["templating"]["list"] if v["type"] == "query"
    }
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = fill_grafana_macros(target["expr"])
            if re.search(r"otel_gpu_(leak|breaker|alerts|memory_time)", expr):
                for name, value in every.items():
                    expr = expr.replace(name, value)
                out.append((panel["title"], expr))
    return out


@pytest.mark.peers
@pytest.mark.parametrize(("title", "expr"), _detector_panels())
def test_the_fleet_dashboards_detector_panels_show_the_processors_output(
    stack: Stack, title: str, expr: str
) -> None:
    assert stack.prom.wait_for("otel_gpu_leak_rate_bytes_per_second", 60)
    # a rate over a range needs two scrapes of the series in it: given time on a loaded machine
    assert stack.prom.wait_for(expr, 30), f"{title} is empty on the processor's output: {expr}"


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _values(leak: float | None, state: int) -> list[outputs.DetectorValues]:
    subject = outputs.SubjectOutput(
        (("service.name", "trainer"),), (("otel_gpu.subject", "gpu:GPU-1"), ("hw.id", "GPU-1"))
    )
    return [outputs.DetectorValues(subject, state, leak, None if leak is None else 7200.0, {})]


@pytest.mark.process
def test_a_series_the_processor_stops_sending_leaves_the_endpoint() -> None:
    scrape = ProcessorScrape("127.0.0.1:0", "--prometheus")
    try:
        port = int(scrape.address.rsplit(":", 1)[1])
        scrape.publish(DETECTOR, outputs.metrics_request(_values(5e5, 2), 0, time.time_ns()))
        before = _scrape(port)
        assert 'otel_gpu_leak_rate_bytes_per_second{hw_id="GPU-1"' in before
        assert 'service_name="trainer"' in before
        # The leak cleared: the processor's next export has the breaker state only.
        scrape.publish(DETECTOR, outputs.metrics_request(_values(None, 1), 0, time.time_ns()))
        after = _scrape(port)
        assert "otel_gpu_leak_rate_bytes_per_second{" not in after
        assert "otel_gpu_memory_time_to_exhaustion_seconds{" not in after
        states = [line for line in after.splitlines() if line.startswith("otel_gpu_breaker_state{")]
        assert len(states) == 1 and states[0].endswith(" 1.0"), after  # half-open, still served
    finally:
        scrape.close()


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--prometheus", "127.0.0.1:{port}"], {}, "--prometheus 127.0.0.1:{port}"),
        ([], {"OTEL_GPU_PROCESSOR_PROMETHEUS": "127.0.0.1:{port}"},
         "OTEL_GPU_PROCESSOR_PROMETHEUS=127.0.0.1:{port}"),
    ],
    ids=["flag", "environment"],
)  # fmt: skip
def test_a_taken_port_is_one_line_and_exit_2_before_serving(
    args: list[str], env: dict[str, str], named: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listen = free_port()
        res = subprocess.run(
            [sys.executable, "-m", "otel_gpu.cli", "processor", "--listen", f"127.0.0.1:{listen}",
             *(a.format(port=port) for a in args)],
            env={**_env(), **{k: v.format(port=port) for k, v in env.items()}},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert named.format(port=port) in lines[0] and "Address already in use" in lines[0]
    assert "listening" not in res.stderr  # the gRPC port was never served


@pytest.mark.process
@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
def test_an_address_not_of_this_host_is_named_with_its_fix(host: str) -> None:
    """Not "a free port": the port is not what is wrong."""
    with pytest.raises(UsageError) as refused:
        ProcessorScrape(f"{host}:9465", "OTEL_GPU_PROCESSOR_PROMETHEUS")
    message = str(refused.value)
    assert f"OTEL_GPU_PROCESSOR_PROMETHEUS={host}:9465" in message
    assert "give an address of this host" in message and "free port" not in message
