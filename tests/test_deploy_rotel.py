"""collector-config/rotel.sh and rotel-backend.sh as shipped, with real rotel binaries:

    replayed leak (OTLP) + an SDK span --> rotel.sh [rotel :A --> otel-gpu processor]
        --> rotel-backend.sh [rotel :B] --> an OTLP receiver standing in for the backend

The backend gets the agent's data, the processor's alert log records and detector metrics
(whose Prometheus names are the ones the alert rules select); SIGTERM to rotel.sh stops rotel, then the processor (which flushes), and leaves no process.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus._mapping import map_unit, sanitize_full_name
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support.collector_scripts import start_script, stop_script
from support.otlp_receiver import Receiver, call, receiver
from support.paths import ROOT
from support.ports import free_port
from support.processor import leak_requests
from support.waits import wait_for_port

from otel_gpu.processor.wire import METRICS_EXPORT, TRACE_EXPORT

pytestmark = pytest.mark.peers


class Chain:
    def __init__(self, front: subprocess.Popen, backend: subprocess.Popen, down: Receiver,
                 address: str, log: str) -> None:  # fmt: skip
        self.front, self.backend, self.down, self.address, self.log = (
            front, backend, down, address, log
        )  # fmt: skip


@pytest.fixture
def chain(tmp_path) -> Iterator[Chain]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's otel_gpu behind the `otel-gpu` script
    env["OTEL_GPU_BREAKER_COOLDOWN_S"] = "1000000"
    front_grpc, processor, backend_grpc = (f"127.0.0.1:{free_port()}" for _ in range(3))
    with receiver() as down:
        backend = start_script(
            "rotel-backend.sh",
            {**env, "ROTEL_GRPC": backend_grpc, "ROTEL_HTTP": f"127.0.0.1:{free_port()}",
             "BACKEND": f"http://{down.address}"},
            str(tmp_path / "backend.log"),
        )  # fmt: skip
        front = start_script(
            "rotel.sh",
            {**env, "ROTEL_GRPC": front_grpc, "ROTEL_HTTP": f"127.0.0.1:{free_port()}",
             "PROCESSOR": processor, "HEALTH": f"127.0.0.1:{free_port()}",
             "DOWNSTREAM": backend_grpc, "STATE": str(tmp_path / "processor.db")},
            str(tmp_path / "front.log"),
        )  # fmt: skip
        try:
            for address in (backend_grpc, processor, front_grpc):
                wait_for_port(address)
            yield Chain(front, backend, down, front_grpc, str(tmp_path / "front.log"))
        finally:
            stop_script(front)
            stop_script(backend)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_replayed_leak_reaches_the_backend_with_the_processors_alert(chain: Chain) -> None:
    t0 = time.time() - 12 * 3600
    for raw in leak_requests(600, start_s=t0):
        call(chain.address, METRICS_EXPORT, raw)
    provider = TracerProvider(resource=Resource.create({"service.name": "via-rotel-sh"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=chain.address, insecure=True))
    )
    with provider.get_tracer("test").start_as_current_span("train"):
        pass
    provider.shutdown()
    down = chain.down
    assert down.wait_for(lambda: len(down.alerts()) >= 2, timeout=60), Path(chain.log).read_text()
    kinds = {
        next(kv.value.string_value for kv in r.attributes if kv.key == "otel_gpu.alert.kind")
        for r in down.alerts()
    }
    assert kinds == {"leak"}
    assert down.wait_for(
        lambda: any(p.as_int == 2 for p in down.metric_points("otel_gpu.breaker.state"))
    )
    assert down.wait_for(lambda: bool(down.metric_points("otel_gpu.leak.rate")))
    assert down.wait_for(lambda: bool(down.metric_points("process.gpu.memory.usage")))
    assert down.wait_for(
        lambda: any(
            s.name == "train" for r in down.decoded(TRACE_EXPORT)
            for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans
        ),
        timeout=30,
    ), "the span never reached the backend"  # fmt: skip
    _check_rule_names(down)


def _prometheus_names(metric) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(OpenTelemetry Python exporter name, Collector prometheus exporter name) of an OTLP
    metric, by the translation both implement (unit suffix, `_total`, `_ratio` on the
    Collector's unit-"1" gauges)."""
    kind = metric.WhichOneof("data")
    unit = map_unit(metric.unit)
    name = sanitize_full_name(metric.name) + (f"_{unit}" if unit else "")
    if kind == "sum" and metric.sum.is_monotonic:
        name += "_total"
    ratio = kind == "gauge" and metric.unit == "1"
    return name, name + "_ratio" if ratio else name


def _check_rule_names(down: Receiver) -> None:
    """The processor's detector metrics translate to the names the alert rules select, both
    when scraped from an OpenTelemetry exporter and behind the Collector."""
    outputs = {
        m.name: m
        for r in down.decoded(METRICS_EXPORT)
        for rm in r.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name.startswith("otel_gpu.")
    }
    rules = (ROOT / "deploy" / "prometheus" / "otel-gpu-rules.yml").read_text()
    for name in (
        "otel_gpu.leak.rate",
        "otel_gpu.memory.time_to_exhaustion",
        "otel_gpu.breaker.state",
    ):
        direct, collector = _prometheus_names(outputs[name])
        matcher = direct if direct == collector else f"{direct}(_ratio)?"
        assert matcher in rules, f"the rules do not select {name} as {direct} / {collector}"
    assert _prometheus_names(outputs["otel_gpu.alerts"])[0] == "otel_gpu_alerts_total"


def test_sigterm_stops_rotel_then_the_processor_and_leaves_nothing(chain: Chain) -> None:
    children = _descendants(chain.front.pid)
    names = " ".join(" ".join(p.cmdline()) for p in children)
    assert "rotel-agent" in names and "processor" in names, names
    for raw in leak_requests(3):
        call(chain.address, METRICS_EXPORT, raw)
    rc = stop_script(chain.front)
    assert rc == 143, Path(chain.log).read_text()
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [], alive
    log = Path(chain.log).read_text()
    assert "stopping" in log  # the processor's own orderly shutdown, not a kill
