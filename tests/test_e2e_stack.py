"""End to end on real parts, as collector-config/ ships them:

    otel-gpu run --simulate leak --no-detect -- opentelemetry-instrument python TRAINER
        --OTLP--> rotel.sh [rotel :A --> otel-gpu processor (OTEL_GPU_PROCESSOR_PROMETHEUS)]
        --> rotel-backend.sh [rotel :B] --> traces: Arize Phoenix (a real trace store)
                                        --> metrics and logs: an OTLP receiver
    the processor's /metrics <-- a real Prometheus 2.42 with deploy/prometheus/ rules

The job runs a training loop with spans in a git repository of its own (known vcs.* values, a
remote URL with a credential in it); the agent leaves detection to the processor. The backends'
HTTP APIs are queried: the spans in Phoenix, the job's resource beside them, the processor's
metric names and the leak alerts firing in Prometheus on the processor's output.

The simulated GPU runs OTEL_GPU_SIMULATE_SPEED times faster than the wall clock, but the points
reach the processor stamped with wall time. The processor's engine is therefore given the
same scale (OTEL_GPU_DETECT_*: its windows divided by the speed, its rate floor multiplied):
it judges the run as the agent's own engine would on the simulation's clock.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.collector_scripts import start_script, stop_script
from support.otlp_sink import OtlpSink
from support.paths import ROOT
from support.phoenix_peer import Phoenix
from support.ports import free_port
from support.prometheus_peer import Prometheus, processor_scrape_config
from support.tiny_training import TRAINING_LOOP
from support.waits import wait_for_port

from otel_gpu.detect.settings import ENV_PREFIX, DetectConfig

pytestmark = pytest.mark.peers

SPEED = 240.0
SERVICE = "e2e-train"
ALERT_WAIT_S = 240  # the processor's leak alert comes after 60-80 s on 2 loaded cores
# The training loop (train > step, evaluate every 40 steps) is test_prometheus_stack's TRAINER.


def simulated_clock(speed: float) -> dict[str, str]:
    """OTEL_GPU_DETECT_* settings under which an engine fed wall-time points of a simulation
    running ``speed`` times faster judges it as on the simulation's clock."""
    env = {}
    defaults = DetectConfig()
    for f in dataclasses.fields(DetectConfig):
        value = getattr(defaults, f.name)
        if f.name.endswith("_per_s"):
            env[ENV_PREFIX + f.name.upper()] = repr(value * speed)
        elif f.name.endswith("_s"):
            env[ENV_PREFIX + f.name.upper()] = repr(value / speed)
    return env


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


class Stack:
    def __init__(self, **parts: Any) -> None:
        self.__dict__.update(parts)
        self.phoenix: Phoenix
        self.prom: Prometheus
        self.sink: OtlpSink
        self.revision: str
        self.logs: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e")
    repo = tmp / "job"
    repo.mkdir()
    (repo / "train.py").write_text(TRAINING_LOOP)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "remote", "add", "origin", "https://ci-bot:s3cr3t-token@git.example.com/ml/job.git")
    _git(repo, "add", "train.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "x")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's otel_gpu behind every `otel-gpu`
    front, processor, backend, scrape = (f"127.0.0.1:{free_port()}" for _ in range(4))
    prom_config = processor_scrape_config(scrape)
    with (
        Phoenix(tmp / "phoenix") as phoenix,
        OtlpSink() as sink,
        Prometheus(tmp / "prometheus", prom_config) as prom,
    ):
        procs: list[subprocess.Popen] = []
        try:
            procs.append(start_script("rotel-backend.sh", {
                **env, "ROTEL_GRPC": backend, "ROTEL_HTTP": f"127.0.0.1:{free_port()}",
                "BACKEND": f"http://{phoenix.otlp_grpc}",  # traces; Phoenix stores no others
                "ROTEL_OTLP_EXPORTER_METRICS_ENDPOINT": sink.endpoint,
                "ROTEL_OTLP_EXPORTER_LOGS_ENDPOINT": sink.endpoint,
            }, str(tmp / "backend.log")))  # fmt: skip
            procs.append(start_script("rotel.sh", {
                **env, **simulated_clock(SPEED),
                "ROTEL_GRPC": front, "ROTEL_HTTP": f"127.0.0.1:{free_port()}",
                "PROCESSOR": processor, "HEALTH": f"127.0.0.1:{free_port()}",
                "DOWNSTREAM": backend, "STATE": str(tmp / "processor.db"),
                "OTEL_GPU_PROCESSOR_PROMETHEUS": scrape,
                "OTEL_GPU_BREAKER_COOLDOWN_S": "1000000",
            }, str(tmp / "front.log")))  # fmt: skip
            for address in (backend, processor, front, scrape):
                wait_for_port(address)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "otel_gpu.cli", "run", "--simulate", "leak", "--no-detect",
                 "--interval", "0.25", "--export-interval", "1", "--quiet",
                 "--endpoint", f"http://{front}", "--",
                 "env", "OTEL_TRACES_EXPORTER=otlp", "OTEL_METRICS_EXPORTER=otlp",
                 "OTEL_LOGS_EXPORTER=none", "OTEL_METRIC_EXPORT_INTERVAL=1000",
                 "OTEL_BSP_SCHEDULE_DELAY=500", f"OTEL_EXPORTER_OTLP_ENDPOINT=http://{front}",
                 "opentelemetry-instrument", sys.executable, "train.py"],
                cwd=repo,
                env={**env, "OTEL_GPU_SIMULATE_SPEED": str(SPEED), "OTEL_SERVICE_NAME": SERVICE,
                     "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={SERVICE}",
                     "OTEL_GPU_LOCK_DIR": str(tmp)},
                stdout=subprocess.DEVNULL, stderr=open(tmp / "agent.log", "wb"),  # noqa: SIM115
                start_new_session=True,
            ))  # fmt: skip
            yield Stack(
                phoenix=phoenix, prom=prom, sink=sink, revision=_git(repo, "rev-parse", "HEAD"),
                logs=tmp,
            )  # fmt: skip
        finally:
            for proc in reversed(procs):  # the job first, then the chain front to back
                stop_script(proc)


def _logs(stack: Stack) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(stack.logs.glob("*.log"))
    )


def _wait(predicate: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(1.0)


def test_the_training_spans_arrive_in_phoenix_with_their_attributes(stack: Stack) -> None:
    def spans() -> list[dict[str, Any]]:
        got = stack.phoenix.spans(SERVICE)
        return got if {"step", "evaluate"} <= {s["name"] for s in got} else []

    found = _wait(spans, 90)
    assert found, f"projects {stack.phoenix.projects()}\n{_logs(stack)}"
    steps = [s for s in found if s["name"] == "step"]
    assert all(isinstance(s["attributes"].get("training.step"), int) for s in steps), steps[:3]
    assert {s["attributes"]["training.step"] for s in steps} >= {1, 2, 3}
    # Every step sits under the run's `train` span (one trace; the root ends with the job).
    assert len({s["context"]["trace_id"] for s in steps}) == 1
    assert all(s["parent_id"] for s in steps)


def test_the_jobs_resource_crosses_the_chain_without_its_credentials(stack: Stack) -> None:
    # Phoenix keeps only the project name of a resource: the rest is read where the same
    # chain delivers the job's metrics.
    def resource() -> dict[str, Any] | None:
        return next((p.resource for p in stack.sink.points() if p.metric == "training.step"), None)

    res = _wait(resource, 60)
    assert res, _logs(stack)
    assert res["service.name"] == SERVICE
    assert res["vcs.ref.head.revision"] == stack.revision
    assert res["vcs.ref.head.name"] == "main"
    assert res["vcs.repository.url.full"] == "https://git.example.com/ml/job"
    everything = repr([p.resource for p in stack.sink.points()]) + repr(stack.sink.logs())
    assert "s3cr3t-token" not in everything


def test_the_leak_alerts_fire_in_prometheus_on_the_processors_output(stack: Stack) -> None:
    firing = stack.prom.wait_for(
        'ALERTS{alertname="GpuMemoryLeak",alertstate="firing"}', ALERT_WAIT_S
    )
    assert firing, f"no leak alert: {stack.prom.api('alerts')}\n{_logs(stack)}"
    assert {a["metric"]["service_name"] for a in firing} == {SERVICE}
    subjects = {a["metric"]["otel_gpu_subject"] for a in firing}
    # One problem, one firing alert per rule (issue 19.6): the process, its GPU as context.
    assert {s.split(":")[0] for s in subjects} == {"process"}, subjects
    opened = stack.prom.wait_for('ALERTS{alertname="GpuBreakerOpen",alertstate="firing"}', 30)
    assert {a["metric"]["otel_gpu_subject"] for a in opened} >= subjects
    # 240x faster, the simulated leak really does fill the GPU within the hour of wall time.
    soon = stack.prom.wait_for(
        'ALERTS{alertname="GpuMemoryExhaustionSoon",alertstate="firing"}', 30
    )
    assert {a["metric"]["otel_gpu_subject"] for a in soon} & subjects, soon
    assert (
        stack.prom.query('ALERTS{alertname=~"GpuNotHealthy|GpuResetXid|GpuUncorrectedErrors"}')
        == []
    )
    # The alert also went downstream as a log record, beside the job's own data.
    assert _wait(
        lambda: any(a.get("otel_gpu.alert.kind") == "leak" for _b, a, _r, _t in stack.sink.logs()),
        30,
    ), "the processor's alert record never reached the logs backend"


@pytest.mark.parametrize(
    "name",
    [
        "otel_gpu_leak_rate_bytes_per_second",
        "otel_gpu_memory_time_to_exhaustion_seconds",
        "otel_gpu_breaker_state",
        'otel_gpu_alerts_total{otel_gpu_alert_kind="leak"}',
        'otel_gpu_processor_requests_accepted_total{signal="traces"} > 0',
        'otel_gpu_processor_requests_accepted_total{signal="metrics"} > 0',
        "otel_gpu_processor_subjects > 0",
    ],
)
def test_the_processors_metric_names_in_prometheus(stack: Stack, name: str) -> None:
    series = stack.prom.wait_for(name, ALERT_WAIT_S)
    assert series, f"{name} never reached Prometheus\n{_logs(stack)}"
