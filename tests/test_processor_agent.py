"""One identity, one notification: the agent and the processor see the same subjects the same
way, and a problem both could detect is notified once.

End to end: a real agent (sampler, instruments, engine, breaker, webhook dispatcher) exports
over the OTel SDK's OTLP gRPC exporter to a real ``otel-gpu processor`` child process on
127.0.0.1, and both are configured to send webhooks to one receiver on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from support.otlp_sink import attrs
from support.processor import ProcessorProcess, in_process_config, leak_requests
from support.synth import GIB, gpu_uuid
from support.webhook import Webhook

from otel_gpu.actions.dispatcher import ActionDispatcher
from otel_gpu.actions.notifiers import JsonNotifier
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.detect.breaker import Breaker, BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.processor.pipeline import Detection
from otel_gpu.processor.store import StateStore
from otel_gpu.processor.wire import METRICS_EXPORT
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, Snapshot
from otel_gpu.sampling.source import DeviceReading, HostInfo

IDENTITY = {"service.name": "trainer", "service.instance.id": "run-1", "host.name": "node-1"}
REPORTER_KEYS = ("service.instance.id", "host.name")


def _breaker_points(req: ExportMetricsServiceRequest) -> list[tuple[dict, dict]]:
    out = []
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "otel_gpu.breaker.state":
                    out += [
                        (attrs(rm.resource.attributes), attrs(p.attributes))
                        for p in m.gauge.data_points
                    ]
    return out


@pytest.mark.unit
def test_agent_and_processor_give_a_subject_the_same_identity(tmp_path: Path) -> None:
    """The GPU and the process on it, as the agent exports them and as the processor exports
    them from the same reporter's data: the same identity attributes, point and resource."""
    sent: list[bytes] = []
    det = Detection(
        in_process_config(),
        Engine(),
        Breaker(BreakerConfig(cooldown_s=1e6)),
        StateStore(str(tmp_path / "state.db")),
        None,
        lambda method, body: sent.append(body) if method == METRICS_EXPORT else None,
    )
    for raw in leak_requests(600):  # reporter run-1 on node-1: GPU 0, process 10000 on it
        det.ingest_metrics(raw)
    det.tick(final=True)
    processor = [_breaker_points(ExportMetricsServiceRequest.FromString(b)) for b in sent]
    from_processor = {frozenset(p.items()): r for r, p in processor[-1]}

    reader = InMemoryMetricReader()
    wd = Watchdog(Engine(), Breaker())
    wd.register_instruments(
        MeterProvider(metric_readers=[reader], resource=Resource.create(IDENTITY)).get_meter("t")
    )
    gpu = GpuSample(uuid=gpu_uuid(0), index=0, memory_used=GIB, processes_listed=True)
    proc = GpuProcessSample(pid=10_000, gpu_uuid=gpu_uuid(0), used_memory=GIB)
    wd.on_snapshot(Snapshot(time=1.0, gpus=(gpu,), gpu_processes=(proc,)))
    data = reader.get_metrics_data()
    from_agent = {
        frozenset(p.attributes.items()): dict(rm.resource.attributes)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "otel_gpu.breaker.state"
        for p in m.data.data_points
    }
    assert len(from_processor) == 2  # both leaked and alerted
    assert set(from_processor) == set(from_agent)
    for key in from_agent:
        point = dict(key)
        assert point["otel_gpu.subject.kind"] in ("gpu", "process_gpu")
        assert point["hw.id"] == gpu_uuid(0)
        for k in REPORTER_KEYS:
            assert from_agent[key][k] == from_processor[key][k] == IDENTITY[k]
    process = next(dict(k) for k in from_agent if dict(k)["otel_gpu.subject.kind"] == "process_gpu")
    assert process["process.pid"] == 10_000 and process["otel_gpu.subject"].startswith("process:")


class LeakingGpu:
    """A one-GPU device source on the wall clock whose memory rises steadily (a DeviceSource)."""

    def __init__(self, rate_bytes_per_s: float) -> None:
        self._t0 = time.time()
        self._rate = rate_bytes_per_s

    def sample(self, job_pids: Sequence[int]) -> DeviceReading:
        used = 10 * GIB + (time.time() - self._t0) * self._rate
        gpu = GpuSample(
            uuid="GPU-e2e-0",
            index=0,
            memory_used=int(used),
            memory_total=80 * GIB,
            util_gpu=0.9,
            power_w=600.0,
            power_limit_w=700.0,
            processes_listed=False,  # process count unknown: only the device leaks
        )
        return DeviceReading(gpus=(gpu,))

    def host_info(self) -> HostInfo:
        return HostInfo(gpu_count=1)

    def close(self) -> None:
        pass


# Seconds-scale leak windows, so a leak is found in seconds of wall time (the data time of
# both the agent and the processor here).
FAST = {
    "leak_bucket_s": 0.5,
    "leak_min_window_s": 6.0,
    "leak_context_s": 6.0,
    "leak_urgent_window_s": 3.0,
}


def _notifications(hook: Webhook) -> list[dict[str, Any]]:
    return [json.loads(b) for b in list(hook.bodies)]


def _wait(predicate: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


@pytest.fixture
def job() -> Iterator[subprocess.Popen]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.kill()
    child.wait()


def _run_agent(
    processor: ProcessorProcess, hook: Webhook, job: subprocess.Popen, detect: bool
) -> tuple[Agent, MeterProvider, Watchdog | None]:
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=processor.address, insecure=True, timeout=5),
        export_interval_millis=250,
    )
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create({**IDENTITY, "service.instance.id": "e2e-1"}),
    )
    agent = Agent(
        Settings(interval_s=0.1, exporter="none", detect=False),
        meter_provider=provider,
        roots=[job.pid],
        source=LeakingGpu(50e6),
    )
    watchdog = None
    if detect:
        watchdog = Watchdog(
            Engine(DetectConfig(**FAST)),
            Breaker(BreakerConfig(cooldown_s=1e6)),
            dispatcher=ActionDispatcher([JsonNotifier(hook.url)], backoff_s=0.2, source="agent"),
        )
        agent.sampler.add_listener(watchdog.on_snapshot)
        watchdog.register_instruments(provider.get_meter("otel_gpu"))
    agent.start()
    return agent, provider, watchdog


def _processor(hook: Webhook) -> ProcessorProcess:
    env = {f"OTEL_GPU_DETECT_{k.upper()}": str(v) for k, v in FAST.items()}
    env.update({"OTEL_GPU_WEBHOOK_URL": hook.url, "OTEL_GPU_BREAKER_COOLDOWN_S": "1000000"})
    return ProcessorProcess(
        "--listen", "127.0.0.1:0", "--health", "127.0.0.1:0", "--export-interval", "0.5", env=env
    )  # fmt: skip


def _stats(processor: ProcessorProcess) -> dict[str, Any]:
    import re

    m = re.search(r"health on (http://\S+)/healthz", processor.output)
    assert m, processor.output
    with urllib.request.urlopen(m.group(1) + "/stats", timeout=5) as r:
        return json.loads(r.read())["detection"]  # type: ignore[no-any-return]


@pytest.mark.peers
@pytest.mark.parametrize(
    "agent_detects", [True, False], ids=["agent-detects", "agent-exports-only"]
)
def test_one_leak_notifies_once_agent_to_processor_to_webhook(
    job: subprocess.Popen, agent_detects: bool
) -> None:
    """With the agent detecting, the webhook gets exactly one notification for the leak, the
    agent's: the processor sees the agent's breaker outputs for that subject and stays quiet.
    Without the agent's detection the same data makes the processor notify (so the first case
    would get two notifications if the processor did not recognise the agent's subjects)."""
    hook = Webhook()
    processor = _processor(hook)
    agent = provider = None
    try:
        agent, provider, watchdog = _run_agent(processor, hook, job, agent_detects)
        assert _wait(lambda: _notifications(hook), 90), processor.output
        # The processor gets the same data a quarter second later: give it ample time to judge.
        first = _notifications(hook)[0]
        deadline = time.monotonic() + 8
        stats = _stats(processor)
        while time.monotonic() < deadline:
            time.sleep(0.5)
            stats = _stats(processor)
        notes = _notifications(hook)
        opened = [n for n in notes if n["to_state"] == "open"]
        if agent_detects:
            assert watchdog is not None and watchdog.alerts[0].kind == "leak"
            assert len(notes) == 1 and len(opened) == 1, notes
            assert first["source"] == "agent" and first["subject"] == "gpu:GPU-e2e-0"
            assert stats["agent_watched"] >= 1 and stats["alerts"] == 0
        else:
            assert opened and {n["source"] for n in notes} == {"otel-gpu processor"}
            assert stats["agent_watched"] == 0 and stats["alerts"] >= 1
            assert "gpu GPU-e2e-0" in opened[0]["subject"]
    finally:
        if agent is not None:
            agent.shutdown(2.0)
        if provider is not None:
            threading.Thread(target=provider.shutdown, daemon=True).start()
        assert processor.terminate() == 0
        hook.close()
