"""One node scraped by a real Prometheus 2.42: `otel-gpu run --simulate leak --exporter
otlp,prometheus` serves /metrics, Prometheus scrapes it, the repository's alert rules fire on the
agent's detector outputs, and every query of every Grafana dashboard runs against that data.

The simulated GPU runs 240x faster than the wall clock (OTEL_GPU_SIMULATE_SPEED), so the
engine sees the two hours of evidence a leak alert needs within about a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from otlp_sink import OtlpSink
from prometheus_peer import ROOT, Prometheus, free_port

RULES = ROOT / "deploy" / "prometheus" / "otel-gpu-rules.yml"
LEAK_WAIT_S = 150  # the leak alert comes after ~35 s on an idle 2-core machine


class Node:
    def __init__(self, prom: Prometheus, sink: OtlpSink, port: int) -> None:
        self.prom, self.sink, self.port = prom, sink, port


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("prometheus-node")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    env.update(
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        OTEL_GPU_SIMULATE_SPEED="240",
        OTEL_GPU_LOCK_DIR=str(tmp),
        OTEL_SERVICE_NAME="leaky-train",
    )
    config = f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: otel-gpu
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""
    with OtlpSink() as sink, Prometheus(tmp / "prometheus", config) as prom:
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "otel_gpu.cli", "run",
                "--simulate", "leak", "--interval", "0.25",
                "--exporter", "otlp,prometheus", "--endpoint", sink.endpoint,
                "--export-interval", "1",
                "--", sys.executable, "-c", "import time; time.sleep(600)",
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            yield Node(prom, sink, port)
        finally:
            agent.terminate()  # forwarded to the job; the agent then flushes and exits
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(5)


# The agent's instruments as the OpenTelemetry Prometheus exporter names them (unit suffixes,
# `_total` on counters, unit "1" without a suffix), with a label each must carry.
SCRAPED = [
    ("hw_gpu_utilization", "hw_gpu_task"),
    ("hw_gpu_memory_usage_bytes", "hw_id"),
    ("hw_gpu_memory_limit_bytes", "hw_id"),
    ("hw_gpu_memory_utilization", "hw_id"),
    ("hw_power_watts", "hw_id"),
    ("hw_energy_joules_total", "hw_id"),
    ("hw_temperature_celsius", "hw_id"),
    ("hw_status", "hw_state"),
    ("process_gpu_memory_usage_bytes", "process_pid"),
    ("process_memory_usage_bytes", "process_pid"),
    ("otel_gpu_breaker_state", "otel_gpu_subject"),
]


@pytest.mark.parametrize(("name", "label"), SCRAPED)
def test_prometheus_scrapes_the_agents_metrics_endpoint(node: Node, name: str, label: str) -> None:
    series = node.prom.wait_for(f'{name}{{job="otel-gpu"}}', timeout_s=30)
    assert series, f"{name} never reached Prometheus; target: {node.prom.api('targets')}"
    assert all(s["metric"].get(label) for s in series), series


def test_the_endpoint_serves_the_resource_as_target_info(node: Node) -> None:
    series = node.prom.wait_for('target_info{job="otel-gpu"}', timeout_s=30)
    assert series and series[0]["metric"]["service_name"] == "leaky-train"


def test_otlp_and_prometheus_exporters_run_together(node: Node) -> None:
    deadline = time.monotonic() + 30
    while not any(p.metric == "hw.gpu.memory.usage" for p in node.sink.points()):
        assert time.monotonic() < deadline, "the OTLP exporter sent nothing beside /metrics"
        time.sleep(0.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/metrics", timeout=5) as reply:
        assert b"hw_gpu_memory_usage_bytes{" in reply.read()


def test_the_alert_rules_fire_on_the_agents_leak_in_prometheus(node: Node) -> None:
    firing = node.prom.wait_for(
        'ALERTS{alertname="GpuMemoryLeak",alertstate="firing"}', LEAK_WAIT_S
    )
    assert firing, f"no leak alert: {node.prom.api('alerts')}"
    subjects = {a["metric"]["otel_gpu_subject"] for a in firing}
    assert any(s.startswith("process:") for s in subjects), subjects
    assert any(s.startswith("gpu:") for s in subjects), subjects
    opened = node.prom.wait_for('ALERTS{alertname="GpuBreakerOpen",alertstate="firing"}', 10)
    assert {a["metric"]["otel_gpu_subject"] for a in opened} >= subjects
    # The simulated GPU is healthy and error-free: those rules stay quiet on the same data.
    quiet = node.prom.query('ALERTS{alertname=~"GpuNotHealthy|GpuUncorrectedErrors"}')
    assert quiet == []
    # The annotation carries the rate the engine measured (2 GiB/h simulated).
    alert = next(
        a for a in node.prom.api("alerts")["alerts"] if a["labels"]["alertname"] == "GpuMemoryLeak"
    )
    assert "B/s" in alert["annotations"]["description"]
