"""Checklist 40, persistence: a disk that refuses writes (a file-size limit on the processor,
so its writes get EFBIG) makes the processor refuse exports with a retry delay, counted, and
everything it answered OK is still delivered; a damaged queue row is skipped, counted and
logged once while every other queued request is delivered."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.otlp_receiver import call
from support.paths import ROOT
from support.ports import free_port
from support.processor import ProcessorProcess
from support.strict_downstream import StrictDownstream
from support.synth import agent_request

from otel_gpu.processor.queue import queue_file
from otel_gpu.processor.wire import METRICS_EXPORT

pytestmark = pytest.mark.process

LIMIT = 256 * 1024  # bytes: the largest file the limited processor may write
T0 = int((time.time() - 3600) * 1e9)


def request(instance: str, k: int) -> bytes:
    return agent_request(  # type: ignore[no-any-return]
        T0 + k * 15_000_000_000, gpus=2, processes=8, instance=instance
    ).SerializeToString()


def limit_file_size() -> None:
    """preexec of the test's own child: files it writes stop at LIMIT bytes (EFBIG, since
    SIGXFSZ is ignored) until it raises its soft limit again."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


class LimitedProcessor:
    """``otel-gpu processor`` as a child process under a file-size limit."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_gpu.cli", "processor", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            preexec_fn=limit_file_size,
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if "listening on" in line:
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        assert ready.wait(30), "processor did not start"
        out = "".join(self.lines)
        self.address = re.search(r"listening on ([^\s;]+)", out).group(1)  # type: ignore[union-attr]
        self.health = re.search(r"health on (http://[^\s;]+)/healthz", out).group(1)  # type: ignore[union-attr]

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.health + "/stats", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(20)
        self._reader.join(5)


def test_a_full_disk_queue_refuses_with_a_retry_delay_and_loses_nothing_it_accepted(tmp_path):
    port = free_port()  # the downstream is down: the disk queue grows until the limit
    qdir = str(tmp_path / "queue")
    common = ["--forward", f"127.0.0.1:{port}", "--queue-dir", qdir, "--flush-timeout", "1"]
    limited = LimitedProcessor("--listen", "127.0.0.1:0", "--health", "127.0.0.1:0", *common)
    accepted, refusals = 0, []
    try:
        for k in range(200):
            try:
                call(limited.address, METRICS_EXPORT, request("full", k))
                accepted += 1
            except grpc.RpcError as e:
                refusals.append(e)
                if len(refusals) == 3:
                    break
        assert accepted > 0 and len(refusals) == 3
        for e in refusals:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot be written" in e.details()
            trailers = dict(e.trailing_metadata())
            assert "google.rpc.retryinfo-bin" in trailers  # the exporter waits and retries
        stats = limited.stats()
        assert stats["signals"]["metrics"] == {"accepted": accepted, "refused": 3}
        (fwd,) = stats["forward"].values()
        assert fwd["refused"] == 3 and fwd["queue_errors"] >= 1
        assert "".join(limited.lines).count("write failed") == 1  # once per episode
    finally:
        limited.terminate()
    down = StrictDownstream(port)
    again = ProcessorProcess("--listen", "127.0.0.1:0", *common)
    try:
        assert down.wait_for(lambda: down.count("full") >= accepted, timeout=30)
        assert down.count("full") == accepted  # every request answered OK, none refused
    finally:
        again.terminate()
        down.close()


STORE_CHILD = textwrap.dedent(
    """
    import resource, sys, time
    import grpc
    from otel_gpu.processor import Processor, ProcessorConfig
    from otel_gpu.processor.admission import Refused
    from tests.support.synth import agent_request
    from otel_gpu.processor.wire import METRICS_EXPORT

    p = Processor(ProcessorConfig(listen="127.0.0.1:0", state_path=sys.argv[1]))
    raw = agent_request(int((time.time() - 3600) * 1e9), gpus=1, processes=0).SerializeToString()
    p.export_metrics(METRICS_EXPORT, raw)
    print("before", p.stats()["signals"]["metrics"], flush=True)
    # history larger than the file-size limit: the writer's commit gets EFBIG
    p._store.commit(None, [], [], {"gpu:big": {"padding": "x" * 600_000}})
    p._store.flush(5)
    try:
        p.export_metrics(METRICS_EXPORT, raw)
        print("accepted while the disk is full", flush=True)
    except Refused as r:
        print("refused", r.code.name, r.retry_s, r.message, flush=True)
    print("health", p.health(), flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    deadline = time.monotonic() + 10
    while p._store.disk_full and time.monotonic() < deadline:
        time.sleep(0.2)  # the writer retries the unwritten history once a second
    p.export_metrics(METRICS_EXPORT, raw)
    print("after", p.stats()["store"], flush=True)
    p.stop(2)
    """
)


def test_a_state_store_on_a_full_disk_refuses_exports_until_it_writes_again(tmp_path):
    state = tmp_path / "state.db"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))

    done = subprocess.run(
        [sys.executable, "-c", STORE_CHILD, str(state)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=limit,
        timeout=60,
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert "before {'accepted': 0, 'refused': 0}" in out  # export_metrics is the body, not rpc
    assert "refused UNAVAILABLE" in out and "state store" in out
    assert "cannot be written" in out
    assert "degraded: the state store" in out
    after = eval(out.split("after ", 1)[1].splitlines()[0])  # noqa: S307 - our own child's dict
    assert after["errors"] >= 1 and not after["failing"]
    # the history that failed was written once the disk had room again
    with contextlib.closing(sqlite3.connect(state)) as db:
        assert db.execute("SELECT COUNT(*) FROM subjects WHERE name = 'gpu:big'").fetchone()[0] == 1


def test_a_damaged_queue_row_is_skipped_counted_and_logged_once(tmp_path):
    port = free_port()
    qdir = tmp_path / "queue"
    common = ["--forward", f"127.0.0.1:{port}", "--queue-dir", str(qdir), "--flush-timeout", "1"]
    first = ProcessorProcess("--listen", "127.0.0.1:0", *common)
    try:
        for k in range(10):
            call(first.address, METRICS_EXPORT, request("kept", k))
    finally:
        first.terminate()  # the downstream was down: all 10 stay on disk
    path = Path(queue_file(str(qdir), f"127.0.0.1:{port}"))
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        # damage two payloads, not the file's page structure
        db.execute(
            "UPDATE queue SET payload = randomblob(LENGTH(payload)) "
            "WHERE id IN (SELECT id FROM queue ORDER BY id LIMIT 2 OFFSET 3)"
        )
    down = StrictDownstream(port)
    second = ProcessorProcess("--listen", "127.0.0.1:0", "--health", "127.0.0.1:0", *common)
    try:
        assert down.wait_for(lambda: down.count("kept") == 8, timeout=30)
        health = re.search(r"health on (http://[^\s;]+)/healthz", second.output).group(1)  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while True:  # the downstream counts a call before the processor hears its answer
            with urllib.request.urlopen(health + "/stats", timeout=5) as r:
                (fwd,) = json.loads(r.read())["forward"].values()
            if fwd["queued"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert fwd["queue_corrupt"] == 2 and fwd["queued"] == 0
        assert down.refused == 0  # no damaged bytes ever reached the downstream
        assert second.output.count("damaged request(s) skipped") == 1
    finally:
        second.terminate()
        down.close()
