"""Never silently blind: stale snapshots are not exported, self-metrics say what went wrong,
``/healthz`` (liveness) turns 503 when sampling is stale or the export thread stalls but never
for a collector that is down, and ``/exportz`` turns 503 when exports keep failing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from support.cli import CLI, clean_env
from support.procfs import blocking_proc_root
from support.scenarios import ONE_GPU_SCENARIO
from support.waits import wait_until

from otel_gpu.agent import instruments as metrics
from otel_gpu.agent import selfmetrics
from otel_gpu.agent.health import HealthServer, agent_check, export_check, export_stall_after
from otel_gpu.agent.selfmetrics import CountingExporter, ExportHealth
from otel_gpu.sampling.sampler import Sampler, stale_after
from otel_gpu.sampling.sim import SimulatedSource


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _collect(reader: InMemoryMetricReader) -> dict[str, list[tuple[float, dict]]]:
    out: dict[str, list[tuple[float, dict]]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(
                    (p.value, dict(p.attributes)) for p in m.data.data_points
                )
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.unit
def test_a_stale_snapshot_is_not_exported_and_its_age_is() -> None:
    mono = Clock()
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=1.0, monotonic=mono)
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    metrics.register(meter, sampler.fresh)
    selfmetrics.register(meter, sampler, ExportHealth())
    sampler.sample_once()
    got = _collect(reader)
    assert got["hw.gpu.memory.usage"] and got["otel_gpu.agent.snapshot.age"][0][0] == 0.0
    # The sampler is stuck: no sweep for longer than three intervals.
    mono.now += stale_after(1.0) + 0.5
    got = _collect(reader)
    assert "hw.gpu.memory.usage" not in got and "hw.power" not in got
    assert got["otel_gpu.agent.snapshot.age"][0][0] == pytest.approx(stale_after(1.0) + 0.5)
    assert "otel_gpu.agent.sweep.duration" not in got  # of a stale sweep: not reported either
    sampler.sample_once()  # sampling resumes: so do the metrics
    assert _collect(reader)["hw.gpu.memory.usage"]


@pytest.mark.process
def test_export_failures_and_dropped_points_are_counted_against_a_dead_collector() -> None:
    health = ExportHealth()
    exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{_closed_port()}", timeout=0.5)
    failing = PeriodicExportingMetricReader(CountingExporter(exporter, health), 3_600_000)
    local = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[failing, local])
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=1.0)
    meter = provider.get_meter("t")
    metrics.register(meter, sampler.fresh)
    selfmetrics.register(meter, sampler, health)
    sampler.sample_once()
    failing.force_flush(timeout_millis=5_000)
    assert health.failures == 1 and health.dropped_points > 10
    assert health.failing_for() >= 0.0 and health.failing_since is not None
    got = _collect(local)
    assert got["otel_gpu.agent.export.failures"][0][0] == 1
    assert got["otel_gpu.agent.export.dropped_points"][0][0] == health.dropped_points
    provider.shutdown(timeout_millis=1_000)


@pytest.mark.unit
def test_nvml_errors_are_counted_by_name_across_sampler_restarts() -> None:
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=1.0)
    sampler.source.error_counts = {"TIMEOUT": 2}  # type: ignore[attr-defined]
    sampler.sample_once()
    assert sampler.nvml_errors() == {"TIMEOUT": 2}
    sampler.carry_errors()  # a new sampling process starts from zero...
    sampler.source.error_counts = {"TIMEOUT": 1, "UNKNOWN": 1}  # type: ignore[attr-defined]
    sampler.sample_once()
    assert sampler.nvml_errors() == {"TIMEOUT": 3, "UNKNOWN": 1}  # ...the total never goes back


@pytest.mark.process
@pytest.mark.parametrize(
    ("age", "failing", "code", "words"),
    [
        (0.5, 0.0, 200, "sampling fresh"),
        (10.0, 0.0, 503, "sampling stale"),
        (0.5, 30.0, 200, "exports failing for 30 s"),  # within the grace
        # Past the grace: said in the body, never a 503 (that would restart a healthy agent).
        (0.5, 90.0, 200, "exports failing for 90 s (1 failed) (see /exportz)"),
    ],
)
def test_healthz_verdicts(age: float, failing: float, code: int, words: str) -> None:
    mono = Clock()
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=1.0, monotonic=mono)
    sampler.sample_once()
    mono.now += age
    export_clock = Clock()
    exports = ExportHealth(clock=export_clock)
    if failing:
        exports.record(False, 10)
        export_clock.now += failing
    server = HealthServer("127.0.0.1:0", {"/healthz": agent_check(sampler, exports, 60.0)})
    try:
        status, body = _get(f"http://{server.address}/healthz")
    finally:
        server.close()
    assert status == code and words in body["reason"] and body["ok"] == (code == 200)


@pytest.mark.unit
def test_exportz_says_whether_metrics_are_delivered_and_healthz_only_names_it() -> None:
    mono = Clock()
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=1.0, monotonic=mono)
    sampler.sample_once()
    clock = Clock()
    exports = ExportHealth(clock=clock)
    live = agent_check(sampler, exports, 60.0, export_stall_s=30.0)
    delivery = export_check(exports, 60.0, export_stall_s=30.0)
    assert delivery() == (True, "no push exporter")  # prometheus only: nothing pushed
    exports.pushing()
    assert delivery() == (True, "no export ended yet")
    exports.record(True, 10)
    assert delivery() == (True, "exports ok") and live() == (True, "sampling fresh (0.0 s)")
    exports.record(False, 10)
    clock.now += 61.0
    exports.record(False, 10)
    assert delivery() == (False, "exports failing for 61 s (2 failed)")
    ok, reason = live()
    assert ok and reason.endswith("exports failing for 61 s (2 failed) (see /exportz)")
    exports.record(True, 10)
    assert delivery() == (True, "exports ok") and live()[0]


@pytest.mark.unit
def test_an_export_thread_that_ends_no_export_is_not_live() -> None:
    """Stuck or gone: nothing will ever be exported again, and a restart is what fixes it."""
    mono = Clock()
    sampler = Sampler(SimulatedSource("steady"), None, interval_s=1.0, monotonic=mono)
    sampler.sample_once()
    clock = Clock()
    exports = ExportHealth(clock=clock)
    live = agent_check(sampler, exports, 60.0, export_stall_s=30.0)
    delivery = export_check(exports, 60.0, export_stall_s=30.0)
    clock.now += 1000.0
    assert live()[0]  # no push exporter: nothing to stall
    exports.pushing()
    clock.now += 29.0
    assert live()[0] and delivery()[0]
    clock.now += 2.0
    stalled = (False, "exports stalled: none ended for 31 s (the export thread is stuck or gone)")
    assert live() == stalled and delivery() == stalled
    exports.record(False, 10)  # a failed export ended: the thread works, the collector does not
    assert live()[0]


@pytest.mark.unit
def test_the_stall_bound_outlasts_three_slow_exports() -> None:
    assert export_stall_after(10.0, 3.0) == 39.0  # the defaults
    assert export_stall_after(0.2, 0.3) == 30.0  # never below 30 s


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.process
def test_health_server_stays_bounded_under_idle_connections() -> None:
    server = HealthServer("127.0.0.1:0", {"/healthz": lambda: (True, "ok")})
    host, port = server.address.rsplit(":", 1)
    idle = []
    try:
        before = len(os.listdir("/proc/self/task"))
        for _ in range(300):  # connections that never send a request
            idle.append(socket.create_connection((host, int(port))))
        time.sleep(0.5)
        threads = len(os.listdir("/proc/self/task"))
        assert threads - before <= 4 + 1  # at most MAX_WORKERS handler threads
    finally:
        for s in idle:
            s.close()
    # Once they are gone, probes are answered again.
    deadline = time.monotonic() + 15
    while True:
        try:
            assert _get(f"http://{server.address}/healthz")[0] == 200
            break
        except (OSError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    server.close()


@pytest.mark.peers
def test_run_healthz_turns_503_while_sampling_is_stuck_and_200_after(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    fake_nvml.write(ONE_GPU_SCENARIO)
    root = blocking_proc_root(tmp_path)  # the first sampler hangs reading it, for ~3.6 s
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [*CLI, "run", "--exporter", "none", "--interval", "0.25", "--health", f"127.0.0.1:{port}",
         "--", sys.executable, "-c", "import time; time.sleep(9)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=fake_nvml.env(
            clean_env(OTEL_GPU_PROC_ROOT=str(root), OTEL_GPU_NVML_TIMEOUT="0.3", OTEL_GPU_DETECT="false")
        ),
    )  # fmt: skip
    seen: list[tuple[int, str]] = []
    try:
        while proc.poll() is None:
            try:
                code, body = _get(f"http://127.0.0.1:{port}/healthz")
                seen.append((code, body["reason"]))
            except OSError:
                pass
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.communicate()
    codes = [c for c, _r in seen]
    assert 503 in codes, seen
    stuck = codes.index(503)
    assert any("no snapshot since start" in r for c, r in seen if c == 503)
    # The restarted sampler skips the blocking PID and really samples: a 200 that says so (not
    # the "restarting" placeholder the agent publishes while no helper runs).
    sampled = [
        r for c, r in seen[stuck:] if c == 200 and "restarting" not in r and "no GPU" not in r
    ]
    assert sampled and all("sampling fresh" in r for r in sampled), seen


@pytest.mark.process
def test_bad_health_address_is_refused_before_the_job_starts(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for value in ("localhost", "127.0.0.1:99999", "nohost:"):
        proc = subprocess.run(
            [*CLI, "run", "--health", value, "--", sys.executable, "-c",
             f"open({str(marker)!r}, 'w')"],
            capture_output=True, text=True, timeout=30, env=clean_env(),
        )  # fmt: skip
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            f"otel-gpu: error: --health={value!r}: use HOST:PORT with a port from 0 to 65535, "
            "e.g. 127.0.0.1:8081 ([::1]:8081 for IPv6)"
        ]
        assert not marker.exists()
    env_proc = subprocess.run(
        [*CLI, "run", "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=30, env=clean_env(OTEL_GPU_HEALTH="x:y"),
    )  # fmt: skip
    assert env_proc.returncode == 2 and "OTEL_GPU_HEALTH='x:y'" in env_proc.stderr


GRACE_S = 1.0  # OTEL_GPU_HEALTH_EXPORT_GRACE below: the 60 s default, scaled down
PAST_GRACE_S = 4 * GRACE_S  # how long exports keep failing past it while /healthz is watched


@pytest.mark.peers
@pytest.mark.parametrize("command", ["run", "sidecar"])
def test_a_real_agent_with_a_dead_collector_stays_live_and_ready(command: str) -> None:
    """Exports fail from the start (nothing listens on the endpoint) for several times the
    grace: /exportz says so with a 503, while /healthz (the liveness probe) stays 200 naming
    it, and the sidecar's /readyz (the inference server's readiness) stays 200."""
    port, dead = _closed_port(), _closed_port()
    common = [
        "--health", f"127.0.0.1:{port}", "--simulate", "steady", "--interval", "0.25",
        "--exporter", "otlp", "--endpoint", f"http://127.0.0.1:{dead}", "--export-interval", "0.2",
    ]  # fmt: skip
    server = None
    if command == "run":
        argv = [*CLI, "run", *common, "--", sys.executable, "-c", "import time; time.sleep(60)"]
    else:  # the sidecar watches a server process of its own, found by --match
        server = subprocess.Popen(["sleep", "60"])
        argv = [*CLI, "sidecar", *common, "--match", "sleep"]
    env = clean_env(
        OTEL_GPU_HEALTH_EXPORT_GRACE=str(GRACE_S),
        OTEL_EXPORTER_OTLP_TIMEOUT="0.3",
        OTEL_GPU_DETECT="false",
    )
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until("/exportz 503", lambda: _get(base + "/exportz")[0] == 503, timeout_s=60)
        code, body = _get(base + "/exportz")
        assert "exports failing for" in body["reason"], body
        seen: list[tuple[int, str]] = []
        deadline = time.monotonic() + PAST_GRACE_S
        while time.monotonic() < deadline:
            seen.append((lambda r: (r[0], r[1]["reason"]))(_get(base + "/healthz")))
            if server is not None:
                assert _get(base + "/readyz") == (
                    200,
                    {"ok": True, "reason": "ready: no serving-fatal condition"},
                )
            time.sleep(0.2)
        assert all(c == 200 for c, _r in seen), seen
        last = seen[-1][1]
        assert "sampling fresh" in last and "exports failing for" in last, last
        failing_for = float(last.split("exports failing for ")[1].split(" s")[0])
        assert failing_for >= GRACE_S + PAST_GRACE_S - 1, last  # well past the grace
        assert proc.poll() is None  # nothing restarted or ended it
    finally:
        proc.kill()
        out, _ = proc.communicate()
        if server is not None:
            server.kill()
            server.wait()
        print(out)
