"""Throughput of `otel-gpu processor` on one core, beside a decode-only floor.

Payload: agent-shaped OTLP metrics requests (otel_gpu.processor.synth): 8 GPUs x 15 device
series + 64 processes x 7 series = 568 data points per request, one request per collection, 4
agents interleaved, 15 s of data time apart.

Figures (all per CPU-second of the measuring process, so they do not depend on how busy the
machine's other cores are):

- floor: ExportMetricsServiceRequest.FromString on every request, nothing else;
- in-process: Processor.export_metrics (decode the detector series, assemble, Engine,
  Breaker, queue for a downstream) with the forwarder sending to a receiver in a child process;
- gRPC: the full service: a client in a child process sends the requests over loopback gRPC,
  the processor receives, decodes, detects and forwards to the downstream child. Its CPU
  seconds include gRPC's own threads. This is the headline figure.

Also: the engine alone (cost per Point), and the processor without the engine (to show where
the time goes). Ends with one JSON line {"name", "value", "baseline", "ratio", "unit"}.

    .venv/bin/python benchmarks/bench_processor.py [--requests 400]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from otel_gpu.detect.breaker import BreakerConfig
from otel_gpu.detect.engine import Engine
from otel_gpu.processor import Downstream, Processor, ProcessorConfig
from otel_gpu.processor.synth import agent_request
from otel_gpu.processor.wire import METRICS_EXPORT

AGENTS = 4

RECEIVER = textwrap.dedent(
    """
    import sys, threading, grpc
    from concurrent import futures
    n = [0]
    def handle(req, ctx):
        n[0] += 1
        return b""
    h = grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=None, response_serializer=None)
    s = grpc.server(futures.ThreadPoolExecutor(4),
        options=[("grpc.max_receive_message_length", 64 << 20)])
    s.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.metrics.v1.MetricsService", {"Export": h})])
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    print(port, flush=True)
    sys.stdin.read()
    print(n[0], flush=True)
    """
)

CLIENT = textwrap.dedent(
    """
    import struct, sys, grpc
    from concurrent import futures
    target, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = open(path, "rb").read()
    reqs, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i); reqs.append(data[i + 4:i + 4 + n]); i += 4 + n
    ch = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = ch.unary_unary("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
        request_serializer=None, response_deserializer=None)
    grpc.channel_ready_future(ch).result(timeout=10)
    sys.stdin.readline()
    # one stream per agent, in order (as each agent's exporter sends)
    def run(k):
        for r in reqs[k::threads]:
            stub(r, timeout=30)
    with futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, range(threads)))
    print("done", flush=True)
    """
)


class _NullEngine:
    def observe(self, subject, point):  # type: ignore[no-untyped-def]
        return []

    def forget(self, subject):  # type: ignore[no-untyped-def]
        pass


def build_requests(n: int) -> tuple[list[bytes], int]:
    t0 = int((time.time() - 86400) * 1e9)
    reqs = []
    for k in range(n):
        agent, step = k % AGENTS, k // AGENTS
        req = agent_request(t0 + step * 15 * 10**9, host=f"node-{agent}", instance=f"run-{agent}")
        reqs.append(req.SerializeToString())
    points = 0
    for rm in ExportMetricsServiceRequest.FromString(reqs[0]).resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points += len(m.gauge.data_points) + len(m.sum.data_points)
    return reqs, points


def cpu_rate(fn, reqs: list[bytes], points: int) -> float:  # type: ignore[no-untyped-def]
    c0 = time.process_time()
    for r in reqs:
        fn(r)
    return len(reqs) * points / (time.process_time() - c0)


def start_receiver() -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    return p, f"127.0.0.1:{p.stdout.readline().strip()}"


def stop_receiver(p: subprocess.Popen[str]) -> int:
    out, _ = p.communicate("", timeout=30)
    return int(out.split()[-1])


def make_processor(down: str, engine, **kw) -> Processor:  # type: ignore[no-untyped-def]
    cfg = ProcessorConfig(
        listen="127.0.0.1:0",
        forward=(Downstream(down),),
        export_interval_s=3600.0,
        queue_requests=100_000,
        queue_bytes=1 << 34,
        **kw,
    )
    return Processor(cfg, engine=engine, breaker_config=BreakerConfig())


def serve_and_measure(address: str, path: str, finish) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Let a client child send every request to ``address``; (CPU s, wall s) of this process
    from the first request until ``finish()`` returns."""
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, address, path, str(AGENTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    time.sleep(0.5)
    c0, w0 = time.process_time(), time.perf_counter()
    client.stdin.write("go\n")
    client.stdin.flush()
    client.stdout.readline()
    finish()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    client.wait(10)
    return cpu, wall


def do_nothing_server() -> tuple[grpc.Server, str]:
    """A Python gRPC server that accepts the export and does nothing: the transport's cost."""
    server = grpc.server(
        futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    handler = grpc.unary_unary_rpc_method_handler(
        lambda r, c: b"", request_deserializer=None, response_serializer=None
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.metrics.v1.MetricsService", {"Export": handler}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3, help="gRPC runs; the best one counts")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    reqs, points = build_requests(args.requests)
    total = len(reqs) * points
    print(f"payload: {len(reqs)} requests x {points} points ({len(reqs[0])} bytes each)")

    floor = max(cpu_rate(ExportMetricsServiceRequest.FromString, reqs, points) for _ in range(3))
    print(f"floor (protobuf parse only):             {floor:12,.0f} points/s")

    with tempfile.NamedTemporaryFile(delete=False) as f:
        for r in reqs:
            f.write(struct.pack("<I", len(r)) + r)
        path = f.name
    recv, down = start_receiver()
    try:
        null = make_processor(down, _NullEngine())
        rate_null = cpu_rate(lambda r: null.export_metrics(METRICS_EXPORT, r), reqs, points)
        null.stop(10)
        print(f"in-process, engine left out:             {rate_null:12,.0f} points/s")

        inproc = make_processor(down, Engine())
        c0 = time.process_time()
        for r in reqs:
            inproc.export_metrics(METRICS_EXPORT, r)
        inproc.stop(30)  # includes draining the forward queue
        rate_inproc = total / (time.process_time() - c0)
        print(f"in-process (decode+detect+forward):      {rate_inproc:12,.0f} points/s")

        from otel_gpu.processor.assemble import Assembler
        from otel_gpu.processor.decode import MetricsDecoder

        pts: list = []
        asm = Assembler(lambda s, p: pts.append((s.name, p)), 100_000, 1.0, 1e9)
        dec = MetricsDecoder(946_684_800.0, 3600.0)
        for r in reqs:
            dec.decode(r, asm, time.time_ns())
        asm.flush_due(0.0, all_pending=True)
        eng = Engine()
        c0 = time.process_time()
        for name, p in pts:
            eng.observe(name, p)
        per_point_us = (time.process_time() - c0) / len(pts) * 1e6
        print(
            f"engine alone: {per_point_us:.1f} us per Point "
            f"({len(pts) / len(reqs):.0f} Points per request)"
        )

        server, address = do_nothing_server()
        cpu, _ = serve_and_measure(address, path, lambda: None)
        server.stop(0)
        rate_transport = total / cpu
        print(f"gRPC do-nothing server (transport only): {rate_transport:12,.0f} points/s")

        best = (0.0, 0.0, {})
        for _ in range(args.repeat):
            served = make_processor(down, Engine())
            served.start()
            cpu, wall = serve_and_measure(served.address, path, lambda s=served: s.stop(30))
            if total / cpu > best[0]:
                best = (total / cpu, total / wall, served.stats()["forward"][down])
        rate_grpc, rate_wall, fwd = best
        print(
            f"over gRPC (receive+decode+detect+forward): {rate_grpc:10,.0f} points/s per CPU-s, "
            f"best of {args.repeat} ({rate_wall:,.0f} points/s wall; {fwd['sent']} requests "
            f"forwarded in {fwd['calls']} calls, {fwd['dropped']} dropped)"
        )
    finally:
        received = stop_receiver(recv)
        os.unlink(path)
    print(f"downstream received {received} calls")
    ratio = rate_grpc / floor
    print(
        f"ratio to the parse floor: {ratio:.3f}; to the do-nothing gRPC server: "
        f"{rate_grpc / rate_transport:.3f}  (targets: >= 250,000 points/s, >= 0.60 of the floor)"
    )
    print(
        json.dumps(
            {
                "name": "processor_throughput_grpc",
                "value": round(rate_grpc),
                "baseline": round(floor),
                "ratio": round(ratio, 3),
                "unit": "points/s",
            }
        )
    )


if __name__ == "__main__":
    main()
