"""Real peers for the processor tests (no tests here): a downstream OTLP gRPC receiver, a raw
gRPC client, a webhook HTTP server, synthetic leak series, and a processor child process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from synth import GIB, agent_request, default_value

from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT, TRACE_EXPORT

ROOT = Path(__file__).resolve().parents[1]
PARSERS = {
    METRICS_EXPORT: ExportMetricsServiceRequest,
    TRACE_EXPORT: ExportTraceServiceRequest,
    LOGS_EXPORT: ExportLogsServiceRequest,
}


def _identity(b: bytes) -> bytes:
    return b


class Receiver:
    """A downstream OTLP gRPC receiver that keeps every request's bytes, per method."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.raw: dict[str, list[bytes]] = {m: [] for m in PARSERS}
        self.delay_s = delay_s
        self._cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {}
        for method in PARSERS:
            service, _, name = method.lstrip("/").rpartition("/")
            handlers.setdefault(service, {})[name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method), request_deserializer=_identity, response_serializer=_identity
            )
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(s, h) for s, h in handlers.items()]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def _handler(self, method: str) -> Callable[[bytes, Any], bytes]:
        def handle(request: bytes, context: Any) -> bytes:
            if self.delay_s:
                time.sleep(self.delay_s)
            with self._cond:
                self.raw[method].append(request)
                self._cond.notify_all()
            return b""

        return handle

    def decoded(self, method: str) -> list[Any]:
        with self._cond:
            return [PARSERS[method].FromString(b) for b in self.raw[method]]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def resources(self, method: str = METRICS_EXPORT) -> int:
        """Resource entries received: one per client request, however calls were merged."""
        total = 0
        for req in self.decoded(method):
            for field in ("resource_metrics", "resource_spans", "resource_logs"):
                if hasattr(req, field):
                    total += len(getattr(req, field))
        return total

    def log_records(self) -> list[Any]:
        out = []
        for req in self.decoded(LOGS_EXPORT):
            for rl in req.resource_logs:
                for sl in rl.scope_logs:
                    out.extend(sl.log_records)
        return out

    def alerts(self) -> list[Any]:
        return [r for r in self.log_records() if r.event_name == "otel_gpu.alert"]

    def metric_points(self, name: str) -> list[Any]:
        out = []
        for req in self.decoded(METRICS_EXPORT):
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            out.extend(m.gauge.data_points or m.sum.data_points)
        return out

    def close(self) -> None:
        self.server.stop(0).wait(2)


def call(
    target: str,
    method: str,
    payload: bytes,
    *,
    metadata=None,
    timeout=5.0,
    channel=None,
    compression=None,
):  # type: ignore[no-untyped-def]
    """Send raw bytes to ``method``; returns (response bytes, call) or raises grpc.RpcError."""
    own = channel is None
    ch = channel or grpc.insecure_channel(target)
    try:
        stub = ch.unary_unary(method, request_serializer=_identity, response_deserializer=_identity)
        return stub.with_call(payload, metadata=metadata, timeout=timeout, compression=compression)
    finally:
        if own:
            ch.close()


def leak_requests(
    n: int,
    *,
    start_s: float | None = None,
    step_s: float = 15.0,
    rate_bytes_per_s: float = 1.33e6,
    instance: str = "run-1",
    first: int = 0,
) -> Iterator[bytes]:
    """A small agent (1 GPU, 1 process) whose process leaks GPU memory steadily."""
    t0 = time.time() - 6 * 3600 if start_s is None else start_s
    for k in range(first, first + n):
        t = t0 + k * step_s

        def value(metric: str, i: int, extra: dict[str, str], t: float = t) -> float | None:
            if metric == "process.gpu.memory.usage":
                return 7 * GIB + (t - t0) * rate_bytes_per_s
            if metric == "hw.gpu.memory.usage":
                return 20 * GIB + (t - t0) * rate_bytes_per_s
            return default_value(metric, i, extra)

        yield agent_request(
            int(t * 1e9), gpus=1, processes=1, instance=instance, value=value
        ).SerializeToString()


class Webhook:
    """An HTTP server on 127.0.0.1 that records POST bodies (a generic webhook target)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", "0"))
                outer.bodies.append(self.rfile.read(n))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/s3cr3t-path"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessorProcess:
    """``otel-gpu processor`` as a child process; waits for its ready line."""

    READY = re.compile(r"listening on ([^\s;]+)")

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        # Only the settings the test gives: none leak in from the developer's shell.
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_gpu.cli", "processor", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=full_env,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                m = self.READY.search(line)
                if m and not ready.is_set():
                    self.address = m.group(1)
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(30) or not self.address:
            self.kill()
            raise AssertionError("processor did not start:\n" + "".join(self.lines))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


@contextmanager
def receiver(delay_s: float = 0.0) -> Iterator[Receiver]:
    r = Receiver(delay_s)
    try:
        yield r
    finally:
        r.close()
