"""Every way a command line leaves the machine, each through its real path: a real child
process whose argv holds credentials, sampled by the real ProcessTree and exported by the SDK
(in-memory reader, console exporter, OTLP to a real gRPC receiver), resources, log records,
alert span events, processor outputs and webhooks received by a real HTTP server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.otlp_sink import OtlpSink
from support.tiny_training import offline_env

from otel_gpu.actions import ActionDispatcher, JsonNotifier, SlackNotifier, add_alert_event
from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.model import LEAK, Alert
from otel_gpu.processor.outputs import SubjectOutput, logs_request

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
GHP = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
PASSWORD = "hunter2-correct-horse"
ARGS = ["--hf_token", HF, "--db-pass", PASSWORD, "--lr", "3e-4"]
REDACTED_ARGS = "--hf_token *** --db-pass *** --lr 3e-4"
SECRETS = (HF, GHP, PASSWORD)
CLI = [sys.executable, "-m", "otel_gpu.cli"]
INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("import time\ntime.sleep(float(__import__('os').environ.get('T', '30')))\n")
    return path


@pytest.fixture
def job(script: Path) -> Iterator[subprocess.Popen]:
    child = subprocess.Popen([sys.executable, str(script), *ARGS])
    yield child
    child.kill()
    child.wait()


def _command_of(reader: InMemoryMetricReader, pid: int) -> dict[str, object]:
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "process.memory.usage":
                    for point in metric.data.data_points:
                        if point.attributes.get("process.pid") == pid:
                            return dict(point.attributes)
    raise AssertionError(f"no process.memory.usage point for {pid}")


@pytest.mark.process
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("redacted", "{exe} {script} " + REDACTED_ARGS),
        ("executable", "{exe} {script}"),
        ("off", None),
    ],
)
def test_process_command_of_a_real_child_in_each_mode(
    job: subprocess.Popen, script: Path, mode: str, expected: str | None
) -> None:
    reader = InMemoryMetricReader()
    settings = Settings.load(
        env={"OTEL_GPU_PROCESS_COMMAND": mode}, simulate="steady", interval_s=0.1, detect=False
    )
    agent = Agent(settings, meter_provider=MeterProvider([reader]), roots=[job.pid]).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            snap = agent.sampler.latest
            if snap is not None and any(p.pid == job.pid for p in snap.processes):
                break
            time.sleep(0.05)
        attrs = _command_of(reader, job.pid)
    finally:
        agent.shutdown(2.0)
    assert attrs["process.executable.name"].startswith("python")  # type: ignore[union-attr]
    assert attrs["process.command"] == sys.executable  # argv[0], the command name, in every mode
    if expected is None:
        assert "process.command_line" not in attrs
    else:
        assert attrs["process.command_line"] == expected.format(exe=sys.executable, script=script)
    assert not any(s in str(attrs) for s in SECRETS)


# Shapes that leaked in full through this path (issue 18, item 17): argv after the script,
# what process.command_line shows, and the secrets it held.
WANDB = "5d8a1f0c93b2e7a64f10c8d2b9e3a7f1c6d4e2b0"
HONEYCOMB = "aF3kq9ZpLm2Xw7RtYb4Ncd"
PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nBKcwggSjAgEAAoIB/AQC7p9+x\n"
SHAPES = [
    (["--api_key2", "numbered-1"], "--api_key2 ***", "numbered-1"),
    (["--hf_token_1", "numbered-2"], "--hf_token_1 ***", "numbered-2"),
    (["--token-v2", "numbered-3"], "--token-v2 ***", "numbered-3"),
    (["--api-key:", "colon-secret"], "--api-key: ***", "colon-secret"),
    (["wandb", "login", WANDB], "wandb login ***", WANDB),
    (["https://idp.example.com/cb#access_token=frag-secret&x=1"],
     "https://idp.example.com/cb#access_token=***&x=1", "frag-secret"),
    (["x-honeycomb-team=" + HONEYCOMB], "x-honeycomb-team=***", HONEYCOMB),
    (["Bearer", "3f9a0c7e1b5d8f2a6c4e"], "Bearer ***", "3f9a0c7e1b5d8f2a6c4e"),
    (["--x", f"-----BEGIN PRIVATE KEY-----\n{PEM_BODY}-----END PRIVATE KEY-----"],
     "--x -----BEGIN PRIVATE KEY-----***-----END PRIVATE KEY-----", "BKcwggSjAgEAAoIB"),
]  # fmt: skip


@pytest.mark.process
def test_issue_shapes_through_real_childs_command_lines(script: Path) -> None:
    """One real child per shape, sampled by the real ProcessTree, exported by the SDK."""
    children = [subprocess.Popen([sys.executable, str(script), *argv]) for argv, _, _ in SHAPES]
    reader = InMemoryMetricReader()
    settings = Settings.load(simulate="steady", interval_s=0.1, detect=False)
    roots = [c.pid for c in children]
    agent = Agent(settings, meter_provider=MeterProvider([reader]), roots=roots).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            snap = agent.sampler.latest
            if snap is not None and set(roots) <= {p.pid for p in snap.processes}:
                break
            time.sleep(0.05)
        commands = [_command_of(reader, pid)["process.command_line"] for pid in roots]
    finally:
        agent.shutdown(2.0)
        for c in children:
            c.kill()
            c.wait()
    for command, (_argv, shown, secret) in zip(commands, SHAPES, strict=True):
        assert command == f"{sys.executable} {script} {shown}"
        assert secret not in str(command)


@pytest.mark.process
def test_console_exporter_shows_no_credential(script: Path, tmp_path: Path) -> None:
    """``otel-gpu run --exporter console``: the job's process.command and the resource (a
    process.command_line and a password given in OTEL_RESOURCE_ATTRIBUTES) are printed
    redacted."""
    line = "python train.py --token=" + GHP
    env = offline_env(
        T="2.5",
        OTEL_GPU_LOCK_DIR=str(tmp_path),
        # A credential under a key that names one, in a value that does not look like one.
        OTEL_RESOURCE_ATTRIBUTES=f"process.command_line={line},deployment.environment=dev,"
        f"db.password={PASSWORD}",
    )
    res = subprocess.run(
        [
            *CLI, "run", "--exporter", "console", "--simulate", "steady", "--interval", "0.2",
            "--export-interval", "0.5", "--no-detect", "--",
            sys.executable, str(script), *ARGS,
        ],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{script} {REDACTED_ARGS}" in res.stdout  # the job, identifiable, its secrets gone
    assert '"process.command_line": "python train.py --token=***"' in res.stdout
    assert not any(s in res.stdout + res.stderr for s in SECRETS)


@pytest.mark.process
def test_bad_process_command_setting_is_one_line_and_exit_2() -> None:
    env = offline_env(OTEL_GPU_PROCESS_COMMAND="full")
    res = subprocess.run(
        [*CLI, "run", "--", "true"], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "otel-gpu: error: OTEL_GPU_PROCESS_COMMAND='full': use one of redacted, executable, off"
    ]


DETECT = """
import json, os, sys
from opentelemetry.sdk.resources import ProcessResourceDetector
from otel_gpu.core.redact_sdk import redact_resource
raw = ProcessResourceDetector(include_command_args=True).detect()
shown = redact_resource(raw, os.environ["OTEL_GPU_PROCESS_COMMAND"])
print(json.dumps([dict(raw.attributes), dict(shown.attributes)]))
"""


@pytest.mark.process
@pytest.mark.parametrize(
    ("mode", "line", "args", "command"),
    [
        ("redacted", "{exe} {script} " + REDACTED_ARGS,
         ["{exe}", "{script}", *REDACTED_ARGS.split()], "{exe}"),
        ("executable", "{exe} {script}", None, "{exe}"),
        ("off", None, None, "{exe}"),  # the command name stays, the line and arguments go
    ],
)  # fmt: skip
def test_process_detector_resource_in_each_mode(
    tmp_path: Path, mode: str, line: str | None, args: list[str] | None, command: str | None
) -> None:
    """The SDK's process detector with command arguments, in a real process whose argv holds
    credentials: what it reports alone, and what is exported instead."""
    script = tmp_path / "detect.py"
    script.write_text(DETECT)
    out = subprocess.run(
        [sys.executable, str(script), *ARGS],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "OTEL_GPU_PROCESS_COMMAND": mode},
    ).stdout  # fmt: skip
    raw, shown = json.loads(out)
    assert HF in raw["process.command_line"] and HF in raw["process.command_args"]

    def fill(text: str | None) -> str | None:
        return None if text is None else text.format(exe=sys.executable, script=script)

    assert shown.get("process.command_line") == fill(line)
    assert shown.get("process.command_args") == (None if args is None else [fill(a) for a in args])
    assert shown.get("process.command") == fill(command)
    assert shown["process.pid"] == raw["process.pid"]  # the rest is kept
    assert not any(s in json.dumps(shown) for s in SECRETS)


@pytest.mark.process
def test_instrumented_job_exports_no_credential(tmp_path: Path) -> None:
    """``opentelemetry-instrument python train.py --hf_token ...`` to a real OTLP receiver: the
    in-process agent's process.command, the resource and the job's log records."""
    job = tmp_path / "train.py"
    job.write_text(
        textwrap.dedent(
            f"""
            import time
            from opentelemetry._logs import get_logger
            from otel_gpu.distro import current_setup
            get_logger("job").emit(body="logged in with HF_TOKEN={HF}",
                                   attributes={{"cmd": "curl -u bob:{PASSWORD} x"}})
            agent = current_setup().agent.wait_started(20)
            deadline = time.monotonic() + 20
            while agent.sampler.latest is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the node agent has sampled this process once
            """
        )
    )
    with OtlpSink() as sink:
        env = offline_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_GPU_SIMULATE="steady",
            OTEL_GPU_INTERVAL="0.2",
            OTEL_GPU_LOCK_DIR=str(tmp_path),  # this job owns its node whatever else runs here
            OTEL_METRIC_EXPORT_INTERVAL="500",
            OTEL_RESOURCE_ATTRIBUTES=f"process.command_line=python train.py --token {GHP}",
        )
        proc = subprocess.run(
            [INSTRUMENT, sys.executable, str(job), *ARGS],
            env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        points = [p for p in sink.points() if "process.command_line" in p.attributes]
        logs = sink.logs()
    commands = {p.attributes["process.command_line"] for p in points}
    assert f"{sys.executable} {job} {REDACTED_ARGS}" in commands
    assert points[0].resource["process.command_line"] == "python train.py --token ***"
    assert ("logged in with HF_TOKEN=***", {"cmd": "curl -u bob:*** x"}) in [
        (body, attrs) for body, attrs, _resource, _trace in logs
    ]
    exported = repr([(p.attributes, p.resource) for p in points]) + repr(logs)
    assert not any(s in exported for s in SECRETS)


# -- alerts: span events, processor log records, webhooks --------------------------------------

ALERT = Alert(
    kind=LEAK,
    subject=f"process:4242@GPU-1 (python train.py --hub_token {HF})",
    time=100.0,
    severity="warning",
    message=f"GPU memory grows 50 MB/h in python train.py --repo {GHP}",
    rate_bytes_per_s=14_000.0,
)
TRANSITION = Transition(ALERT.subject, "closed", "open", 100.0, ALERT.message, ALERT, 1)


@pytest.mark.unit
def test_alert_span_event_is_redacted() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("train") as span:
        assert add_alert_event(ALERT, span)
    (event,) = exporter.get_finished_spans()[0].events
    attrs = dict(event.attributes or {})
    assert attrs["otel_gpu.alert.message"] == (
        "GPU memory grows 50 MB/h in python train.py --repo ghp_***"
    )
    assert attrs["otel_gpu.alert.subject"] == "process:4242@GPU-1 (python train.py --hub_token ***"
    assert not any(s in repr(attrs) for s in SECRETS)


@pytest.mark.unit
def test_processor_alert_records_are_redacted() -> None:
    subject = SubjectOutput((("service.name", "trainer"),), (("process.pid", 4242),))
    req = ExportLogsServiceRequest.FromString(
        logs_request([(subject, ALERT)], [(subject, TRANSITION)], 1)
    )
    records = req.resource_logs[0].scope_logs[0].log_records
    bodies = [r.body.string_value for r in records]
    assert bodies == ["GPU memory grows 50 MB/h in python train.py --repo ghp_***"] * 2
    assert not any(s in str(req) for s in SECRETS)


class _Receiver:
    """A webhook endpoint on 127.0.0.1 keeping every POST body."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.got = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.end_headers()
                with receiver.got:
                    receiver.bodies.append(body)
                    receiver.got.notify_all()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[bytes]:
        with self.got:
            self.got.wait_for(lambda: len(self.bodies) >= n, timeout)
            return list(self.bodies)


@pytest.mark.process
def test_webhooks_carry_no_credential() -> None:
    receiver = _Receiver()
    try:
        dispatcher = ActionDispatcher(
            [JsonNotifier(receiver.url + "/hook"), SlackNotifier(receiver.url + "/slack")],
            span_events=False,
        )
        dispatcher.on_transition(TRANSITION)
        bodies = receiver.wait_for(2)
        dispatcher.close(2.0)
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
    assert len(bodies) == 2
    docs = [json.loads(b) for b in bodies]
    generic = next(d for d in docs if "alert" in d)
    assert generic["alert"]["message"].endswith("--repo ghp_***")
    assert generic["subject"] == "process:4242@GPU-1 (python train.py --hub_token ***"
    slack = next(d for d in docs if "alert" not in d)
    assert "--repo ghp_***" in slack["text"]
    assert not any(s.encode() in b for s in SECRETS for b in bodies)


@pytest.mark.process
def test_the_setting_is_an_opentelemetry_instrument_flag() -> None:
    out = subprocess.run([INSTRUMENT, "--help"], capture_output=True, text=True, timeout=60)
    assert "--gpu_process_command" in out.stdout


@pytest.mark.unit
def test_agent_settings_default_to_redacted() -> None:
    assert Settings.load(env={}).process_command == "redacted"
    assert Settings.load(env={"OTEL_GPU_PROCESS_COMMAND": " Executable "}).process_command == (
        "executable"
    )
