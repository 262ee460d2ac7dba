"""``otel-gpu sidecar`` in a real pod-like PID namespace (``unshare --pid --fork --mount-proc``, as
root), beside a real HTTP server serving vLLM metrics from its own nested namespace, on the fake
NVML: the server is discovered (its PID in the sidecar's namespace and its own, process.vpid),
/readyz turns 503 on Xid 79, on requests waiting while the GPU idles and on a lost GPU, and back
to 200 after probation, /healthz turns 503 while sampling is frozen, and SIGTERM ends the
sidecar within its shutdown bound."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fakenvml.fixtures import FakeNvml
from support.cli import clean_env
from support.inference import VLLM
from support.otlp_sink import OtlpSink
from support.paths import ROOT
from support.ports import free_port
from support.waits import wait_until

SCENARIO = """
devices = 1
gpu.0.uuid = GPU-5e1dca40-0000-4000-8000-000000000001
gpu.0.memory.total = 85899345920
gpu.0.memory.used = 21474836480
gpu.0.util.gpu = 60
"""
SHUTDOWN_BOUND_S = 5.0  # OTEL_GPU_SHUTDOWN_TIMEOUT below


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())["reason"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["reason"]


class Pod:
    """PID 1 (sh) of a new PID namespace, with the server in a nested one and the sidecar."""

    def __init__(self, fake: FakeNvml, tmp_path: Path, sink: OtlpSink) -> None:
        self.metrics_dir = tmp_path / "www"
        self.metrics_dir.mkdir()
        (self.metrics_dir / "metrics").write_text(VLLM)
        self.server_port, self.health_port = free_port(), free_port()
        sidecar = [
            sys.executable, "-m", "otel_gpu.cli", "sidecar",
            "--health", f"127.0.0.1:{self.health_port}",
            "--server-metrics", f"http://127.0.0.1:{self.server_port}/metrics",
            "--interval", "0.5", "--endpoint", sink.endpoint, "--export-interval", "1",
        ]  # fmt: skip
        server = [
            "unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "http.server",
            "--bind", "127.0.0.1", "--directory", str(self.metrics_dir), str(self.server_port),
        ]  # fmt: skip
        script = f"{_sh(server)} >/dev/null 2>&1 & {_sh(sidecar)} & wait"
        env = fake.env(
            clean_env(
                PYTHONPATH=str(ROOT),  # this checkout's otel_gpu, in every process of the pod
                OTEL_GPU_BREAKER_COOLDOWN_S="1",
                OTEL_GPU_BREAKER_PROBATION_S="2",
                OTEL_GPU_SHUTDOWN_TIMEOUT=str(SHUTDOWN_BOUND_S),
                OTEL_GPU_NVML_TIMEOUT="0.5",
                OTEL_GPU_READY_STALL="2",
                K8S_POD_NAME="vllm-0",
                K8S_NAMESPACE_NAME="serving",
            )
        )
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", script],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.health_port}"

    def process(self, needle: str) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                argv = p.cmdline()
                if argv[:1] == [sys.executable] and needle in " ".join(argv):
                    return p  # the Python process itself, not sh or unshare around it
            except psutil.Error:
                continue
        raise AssertionError(f"no {needle!r} process in the pod")

    def close(self) -> str:
        everyone = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.kill()  # --kill-child: PID 1 dies, and with it the whole namespace
        out, _ = self.proc.communicate(timeout=30)
        _gone, alive = psutil.wait_procs(everyone, timeout=10)
        assert not alive, f"left running: {alive}"
        return out


def _sh(argv: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


@pytest.fixture
def pod(fake_nvml: FakeNvml, tmp_path: Path) -> Iterator[tuple[Pod, OtlpSink, FakeNvml]]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare(1) (util-linux) to make a PID namespace")
    fake_nvml.write(SCENARIO)
    with OtlpSink() as sink:
        pod = Pod(fake_nvml, tmp_path, sink)
        try:
            yield pod, sink, fake_nvml
        finally:
            print(pod.close())


@pytest.mark.peers
def test_sidecar_in_a_pid_namespace(pod: tuple[Pod, OtlpSink, FakeNvml]) -> None:
    p, sink, fake = pod
    wait_until("/healthz 200", lambda: _get(p.url + "/healthz")[0] == 200)
    assert _get(p.url + "/readyz") == (200, "ready: no serving-fatal condition")

    # Discovery: the server, seen from the sidecar's namespace, is PID 1 of its own.
    server = p.process("http.server")

    def server_points() -> list:  # noqa: E306
        return [
            pt for pt in sink.points()
            if pt.metric == "process.memory.usage" and pt.attributes.get("process.vpid") == 1
        ]  # fmt: skip

    found = wait_until("the server's process metrics", server_points)
    attrs = found[-1].attributes  # type: ignore[index]
    assert attrs["process.executable.name"].startswith("python")
    assert attrs["process.pid"] != server.pid  # the sidecar's namespace PID, not the host's
    # The sidecar's default: the program and its module, none of the arguments.
    assert attrs["process.command"] == f"{sys.executable} -m http.server"
    resource = found[-1].resource  # type: ignore[index]
    assert (resource["k8s.pod.name"], resource["k8s.namespace.name"]) == ("vllm-0", "serving")
    waiting = wait_until(
        "the normalized server metrics",
        lambda: [pt for pt in sink.points() if pt.metric == "otel_gpu.inference.requests.waiting"],
    )
    assert waiting[-1].value == 3.0 and waiting[-1].attributes == {
        "otel_gpu.inference.engine": "vllm"
    }  # type: ignore[index]

    # Xid 79: not ready, then ready again after the cool-down (1 s) and probation (2 s).
    fake.append("gpu.0.xid = 79")
    code, reason = wait_until(
        "503 on Xid 79", lambda: (r := _get(p.url + "/readyz"))[0] == 503 and r
    )  # type: ignore[misc]
    assert "Xid 79 (needs a reset)" in reason
    wait_until("ready after probation", lambda: _get(p.url + "/readyz")[0] == 200)
    fake.write(SCENARIO)

    # A serving stall: vLLM says 3 requests wait while the GPU idles (OTEL_GPU_READY_STALL=2).
    fake.append("gpu.0.util.gpu = 0")
    reason = wait_until("503 on a stall", lambda: (r := _get(p.url + "/readyz"))[0] == 503 and r[1])
    assert "3 request(s) waiting" in str(reason) and "vllm server is hung" in str(reason)
    fake.write(SCENARIO)  # busy again: ready after the cool-down and probation
    wait_until("ready after the stall", lambda: _get(p.url + "/readyz")[0] == 200)

    # Frozen sampling: /healthz 503 while the helper is stopped, 200 once it runs again.
    helper = p.process("otel_gpu.sampling.worker")
    helper.send_signal(signal.SIGSTOP)
    try:
        reason = wait_until(
            "stale /healthz", lambda: (r := _get(p.url + "/healthz"))[0] == 503 and r[1]
        )
        assert "stale" in str(reason)
    finally:
        helper.send_signal(signal.SIGCONT)
    wait_until("fresh /healthz", lambda: _get(p.url + "/healthz")[0] == 200)

    # A lost GPU: not ready while it is gone.
    fake.append("fail.*.0 = GPU_IS_LOST")
    reason = wait_until(
        "503 on a lost GPU", lambda: (r := _get(p.url + "/readyz"))[0] == 503 and r[1]
    )
    assert "is lost" in str(reason)

    # SIGTERM (what Kubernetes sends): the sidecar and its helper end within the bound.
    sidecar = p.process("otel_gpu.cli sidecar")
    family = [sidecar, *sidecar.children(recursive=True)]
    sidecar.send_signal(signal.SIGTERM)
    _gone, alive = psutil.wait_procs(family, timeout=SHUTDOWN_BOUND_S + 5)
    assert not alive


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["--server-metrics", "ftp://x"], {},
         "otel-gpu: error: --server-metrics ftp://x: use the server's Prometheus URL, e.g. http://127.0.0.1:8000/metrics"),
        ([], {"OTEL_GPU_SERVER_METRICS": "localhost:8000"},
         "otel-gpu: error: OTEL_GPU_SERVER_METRICS=localhost:8000: use the server's Prometheus URL, e.g. http://127.0.0.1:8000/metrics"),
        (["--match", " "], {}, "otel-gpu: error: --match needs a process name, e.g. --match vllm"),
        (["--pod-logs", "/mnt/pods"], {},
         "otel-gpu: error: --pod-logs /mnt/pods: the pod log folders only name the pods of the node's GPUs with --pod-resources; add --pod-resources SOCKET or drop --pod-logs"),
        ([], {"OTEL_GPU_READY_STALL": "0"},
         "otel-gpu: error: OTEL_GPU_READY_STALL='0': use a number of seconds from 1 to 86400"),
        ([], {"OTEL_GPU_READY_XIDS": "79;48"},
         "otel-gpu: error: OTEL_GPU_READY_XIDS='79;48': use Xid numbers separated by commas (e.g. 79,48,95) or none"),
    ],
)  # fmt: skip
def test_bad_sidecar_settings_are_one_line_and_exit_2(
    args: list[str], env: dict[str, str], line: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "sidecar", "--exporter", "none", *args],
        capture_output=True, text=True, timeout=60, env=clean_env(**env),
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]


@pytest.mark.process
def test_sidecar_records_what_it_sampled_and_analyze_replays_it(tmp_path: Path) -> None:
    # A server process with a name of its own, so --match finds it and nothing else.
    exe = tmp_path / "otelgpu-rec-server"
    exe.symlink_to(sys.executable)
    server = subprocess.Popen([str(exe), "-c", "import time; time.sleep(60)"])
    record = tmp_path / "pod.csv"
    summary = tmp_path / "summary.json"
    try:
        side = subprocess.Popen(
            [sys.executable, "-m", "otel_gpu.cli", "sidecar", "--match", "otelgpu-rec-server",
             "--simulate", "leak", "--interval", "0.2", "--exporter", "none",
             "--record", str(record), "--summary-json", str(summary)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        )  # fmt: skip
        wait_until("rows recorded", lambda: record.exists() and record.stat().st_size > 2000, 60)
        side.send_signal(signal.SIGTERM)
        out, err = side.communicate(timeout=30)
    finally:
        server.kill()
        server.wait()
    assert side.returncode == 0, err
    assert "up 00:" not in err  # no live view in a pod's log unless --view
    # the context lines (outputs/record.py) are comments, not samples
    header, *rows = [r for r in record.read_text().splitlines() if not r.startswith("#")]
    assert "subject" in header.split(",") and rows
    subjects = {r.split(",")[header.split(",").index("subject")] for r in rows}
    assert any(s.startswith("gpu:") for s in subjects)
    assert any(s.startswith(f"process:{server.pid}@") for s in subjects)
    replay = subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "analyze", str(record)],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    assert f"{len(rows)} samples" in replay.stderr
    assert json.loads(summary.read_text())["gpus"]


@pytest.mark.process
def test_match_finds_a_python_job_by_its_script_name(tmp_path: Path) -> None:
    # Issue 19.8: `--match train` never matched `python train.py` (comm is python3.11).
    from otel_gpu.k8s.sidecar import _named

    script = tmp_path / "mytrainjob.py"
    script.write_text("import time\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-u", str(script)])
    try:
        import time

        deadline = time.monotonic() + 10
        while b"mytrainjob" not in Path(f"/proc/{child.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _named(child.pid, ["mytrainjob"], "/proc")
        assert _named(child.pid, ["python"], "/proc")
        assert not _named(child.pid, ["vllm"], "/proc")
    finally:
        child.kill()
        child.wait()
