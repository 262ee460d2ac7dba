"""Trickling clients cannot take a probe out of rotation (issue 18, item 4).

Before the fix the bounded HTTP server's timeout was per ``recv``: a client sending one byte
every 0.5 s held a worker for as long as it liked, and four of them held every worker of the
sidecar's ``/readyz`` and ``/healthz`` (0 of 20 probes answered), eight the Prometheus
endpoints, 32 the processor's ``--health``. Now a request head is read without holding a
worker, under a deadline for the whole request, and probe paths have a reserved worker. Each
server here is the real one in its real process, over real sockets on 127.0.0.1."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.ports import free_port
from support.tiny_training import offline_env

from otel_gpu.agent.health import HealthServer
from otel_gpu.core.http import Reply, RouteServer

CLI = [sys.executable, "-m", "otel_gpu.cli"]
LINE = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: trickle\r\n"  # never ended


@contextmanager
def tricklers(port: int, n: int, every_s: float = 0.5) -> Iterator[None]:
    """``n`` connections to ``port`` each sending one byte every ``every_s`` (never a whole
    request); one a server closes is opened again at once, so the pressure never lets up."""
    stop = threading.Event()

    def run() -> None:
        socks: list[tuple[socket.socket, int] | None] = [None] * n
        while not stop.is_set():
            for i in range(n):
                entry = socks[i]
                if entry is None:
                    try:
                        entry = (socket.create_connection(("127.0.0.1", port), timeout=1), 0)
                    except OSError:
                        continue
                sock, sent = entry
                try:
                    sock.send(LINE[sent % len(LINE) : sent % len(LINE) + 1])
                    socks[i] = (sock, sent + 1)
                except OSError:  # closed by the server: open another one
                    sock.close()
                    socks[i] = None
            stop.wait(every_s)
        for entry in socks:
            if entry is not None:
                entry[0].close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        time.sleep(2 * every_s)  # every trickler connected and sending
        yield
    finally:
        stop.set()
        thread.join(5)


def answered(port: int, path: str, probes: int = 20, timeout_s: float = 3.0) -> int:
    """How many of ``probes`` GETs of ``path`` got an HTTP answer within ``timeout_s``."""
    ok = 0
    for _ in range(probes):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s):
                ok += 1
        except urllib.error.HTTPError:
            ok += 1  # a 503 is an answer: the probe was served
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.05)
    return ok


def wait_answering(port: int, path: str, within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while answered(port, path, probes=1, timeout_s=2.0) != 1:
        assert time.monotonic() < end, f"nothing answers {path} on {port}"
        time.sleep(0.2)


@pytest.mark.process
def test_sidecar_style_health_server_answers_probes_under_32_trickling_clients() -> None:
    # The class the sidecar serves /healthz and /readyz with (4 workers).
    server = HealthServer(
        "127.0.0.1:0", {"/healthz": lambda: (True, "ok"), "/readyz": lambda: (False, "busy")}
    )
    port = int(server.address.rsplit(":", 1)[1])
    try:
        with tricklers(port, 32):
            assert answered(port, "/readyz") >= 19
            assert answered(port, "/healthz") >= 19
    finally:
        server.close()


@pytest.mark.process
def test_a_trickling_request_is_closed_at_its_deadline_not_kept_by_each_byte() -> None:
    server = HealthServer("127.0.0.1:0", {"/healthz": lambda: (True, "ok")})  # 1 s deadline
    port = int(server.address.rsplit(":", 1)[1])
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        start = time.monotonic()
        closed_after = None
        for k in range(40):  # one byte every 0.2 s: far inside any per-recv timeout
            try:
                sock.send(LINE[k : k + 1])
            except OSError:
                closed_after = time.monotonic() - start
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                pass
        sock.close()
        assert closed_after is not None and closed_after < 2.5, closed_after
    finally:
        server.close()


@pytest.mark.process
def test_probes_have_a_worker_that_slow_routes_cannot_take() -> None:
    """Every worker busy on a slow route (a scraper, a /stats reader): /healthz still served."""
    release = threading.Event()

    def slow() -> Reply:
        release.wait(10)
        return Reply(200, "slow\n")

    server = RouteServer(
        "127.0.0.1:0",
        {"/healthz": lambda: Reply(200, "ok\n"), "/stats": slow},
        source="--health",
        max_connections=2,
        idle_s=2.0,
        not_found=lambda _k: Reply(404, "no\n"),
    )
    port = server.port
    held = [
        threading.Thread(target=answered, args=(port, "/stats", 1, 12.0), daemon=True)
        for _ in range(2)
    ]
    try:
        for t in held:
            t.start()
        time.sleep(0.5)  # both workers are inside slow()
        assert answered(port, "/stats", probes=1, timeout_s=1.0) == 0  # no worker for it
        assert answered(port, "/healthz", probes=10) == 10
    finally:
        release.set()
        for t in held:
            t.join(15)
        server.close()


@pytest.mark.peers  # three real services, each started and trickled for seconds
def test_real_services_answer_probes_and_scrapes_under_trickling_clients(tmp_path: Path) -> None:
    env = offline_env(OTEL_GPU_LOCK_DIR=str(tmp_path), OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1")
    ports = {name: free_port() for name in ("sidecar", "sidecar_m", "run", "run_m", "ph", "pm")}
    procs = [
        subprocess.Popen(
            [*CLI, "sidecar", "--simulate", "steady", "--interval", "0.2", "--exporter",
             "prometheus", "--health", f"127.0.0.1:{ports['sidecar']}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
            env={**env, "OTEL_EXPORTER_PROMETHEUS_PORT": str(ports["sidecar_m"])},
        ),
        subprocess.Popen(
            [*CLI, "run", "--simulate", "steady", "--interval", "0.2", "--exporter",
             "prometheus", "--health", f"127.0.0.1:{ports['run']}", "--", "sleep", "120"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
            env={**env, "OTEL_EXPORTER_PROMETHEUS_PORT": str(ports["run_m"])},
        ),
        subprocess.Popen(
            [*CLI, "processor", "--listen", "127.0.0.1:0", "--health",
             f"127.0.0.1:{ports['ph']}", "--prometheus", f"127.0.0.1:{ports['pm']}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path, env=env,
        ),
    ]  # fmt: skip
    # (port, path probed, tricklers: more than the server's workers)
    cases = [
        (ports["sidecar"], "/readyz", 8),
        (ports["sidecar"], "/healthz", 8),
        (ports["sidecar_m"], "/metrics", 16),
        (ports["run"], "/healthz", 8),
        (ports["run_m"], "/metrics", 16),
        (ports["ph"], "/healthz", 40),
        (ports["pm"], "/metrics", 16),
    ]
    try:
        for port, path, _ in cases:
            wait_answering(port, path)
        got = {}
        for port, path, n in cases:
            with tricklers(port, n):
                got[(port, path)] = answered(port, path)
        assert all(v >= 19 for v in got.values()), got
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
