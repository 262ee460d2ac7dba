"""Throughput of `otel-gpu processor` on one core, beside a decode-only floor.

Payload: agent-shaped OTLP metrics requests (tests/support/synth.py): 8 GPUs x 15 device
series + 64 processes x 7 series = 568 data points per request, one request per collection, 4
agents sending concurrently, 15 s of data time apart, memory, utilization and power jittering
as on a busy node. The processor is measured in steady state: its engine first takes
``--warmup-hours`` of the same streams (unmeasured), so leak windows of an hour and more are
being judged, as in a long-running deployment.

Every figure is data points per CPU-second of this process (all its threads: gRPC's, the
processor's, the forwarder's), so it does not depend on how busy the machine's other cores are.

Headline and baseline, measured alternately in the same run (``--repeat`` times each; the
median counts, min and max are printed):

- processor over gRPC: a client in a child process sends the requests over loopback gRPC; the
  processor receives, decodes the detector series, assembles, runs the Engine and Breaker, and
  forwards every request to a downstream receiver (another child process).
- decode-only floor over gRPC (the baseline): the same client, requests and transport (a gRPC
  server configured like the processor's), with a handler that does the generic decode any
  processor must do to look at OTLP data, and nothing else: a full protobuf parse, and for
  every resource and every data point its attributes as a dict (key -> AnyValue) plus its
  timestamp and value. No detection, no forwarding. (docs/background.md §3 measured this walk at
  0.4 M points/s in-process and 0.33-0.38 M points/s over gRPC on one core.)

ratio = processor / floor. Targets: >= 250,000 points/s and ratio >= 0.60.

For transparency (not the baseline): the protobuf parse alone and the generic decode alone
(in-process, no gRPC), the transport alone (the same gRPC server with a handler that does
nothing), the processor in-process with and without the engine, and the engine alone per Point.
Ends with one JSON line {"name", "value", "baseline", "ratio", "unit"}.

    .venv/bin/python benchmarks/bench_processor.py [--requests 400] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (  # noqa: E402
    ExportMetricsServiceRequest,
)
from support.synth import agent_request  # noqa: E402

from otel_gpu.detect.breaker import BreakerConfig  # noqa: E402
from otel_gpu.detect.engine import Engine  # noqa: E402
from otel_gpu.detect.settings import DetectConfig  # noqa: E402
from otel_gpu.processor import Downstream, Processor, ProcessorConfig  # noqa: E402
from otel_gpu.processor.assemble import Assembler  # noqa: E402
from otel_gpu.processor.decode import MetricsDecoder  # noqa: E402
from otel_gpu.processor.wire import METRICS_EXPORT, METRICS_SERVICE  # noqa: E402

AGENTS = 4
STEP_NS = 15 * 10**9

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
    config = DetectConfig()  # the processor reads its windows

    def observe(self, subject, point):  # type: ignore[no-untyped-def]
        return []

    def active_kinds(self, subject):  # type: ignore[no-untyped-def]
        return frozenset()

    def conditions(self, subject):  # type: ignore[no-untyped-def]
        return []

    def forget(self, subject):  # type: ignore[no-untyped-def]
        pass


# -- payload ---------------------------------------------------------------------------------

_JITTER = {  # metric -> (relative spread, absolute spread) of its value from step to step
    "hw.gpu.memory.usage": (0.0, 96 * 2**20),
    "process.gpu.memory.usage": (0.0, 64 * 2**20),
    "process.memory.usage": (0.0, 128 * 2**20),
    "hw.gpu.utilization": (0.04, 0.0),
    "hw.power": (0.05, 0.0),
    "hw.temperature": (0.02, 0.0),
}


class _AgentStream:
    """One agent's requests at successive collections: one message updated in place (fast)."""

    def __init__(self, k: int, t0: int) -> None:
        self.req = agent_request(t0, host=f"node-{k}", instance=f"run-{k}", start_ns=t0 - 10**12)
        self.rng = random.Random(k)
        self.points: list[tuple[Any, float, float, float, bool]] = []
        for rm in self.req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    data = m.gauge if m.HasField("gauge") else m.sum
                    rel, ab = _JITTER.get(m.name, (0.0, 0.0))
                    for dp in data.data_points:
                        is_int = dp.WhichOneof("value") == "as_int"
                        base = float(dp.as_int if is_int else dp.as_double)
                        self.points.append((dp, base, rel, ab, is_int))

    def at(self, t_ns: int) -> bytes:
        rnd = self.rng.random
        for dp, base, rel, ab, is_int in self.points:
            dp.time_unix_nano = t_ns
            if rel or ab:
                v = base * (1.0 - rel * rnd()) + ab * rnd()
                if is_int:
                    dp.as_int = int(v)
                else:
                    dp.as_double = v
        return self.req.SerializeToString()  # type: ignore[no-any-return]


def build_requests(steps: int, t0: int) -> list[bytes]:
    """``steps`` collections of every agent, interleaved in time."""
    agents = [_AgentStream(k, t0) for k in range(AGENTS)]
    return [a.at(t0 + s * STEP_NS) for s in range(steps) for a in agents]


def count_points(raw: bytes) -> int:
    n = 0
    for rm in ExportMetricsServiceRequest.FromString(raw).resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                n += len(m.gauge.data_points) + len(m.sum.data_points)
    return n


# -- the floor: generic decode ---------------------------------------------------------------


def generic_decode(raw: bytes) -> int:
    """What any processor must do to look at OTLP metrics: parse everything, and per resource
    and data point its attributes as a dict (key -> AnyValue), its timestamp and its value.
    Returns the points seen. (Converting every AnyValue to a Python value as well costs ~30%
    more; the cheaper walk keeps the floor, and so the ratio, conservative.)"""
    req = ExportMetricsServiceRequest.FromString(raw)
    n = 0
    for rm in req.resource_metrics:
        resource = {kv.key: kv.value for kv in rm.resource.attributes}
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind is None:
                    continue
                number = kind in ("gauge", "sum")
                for dp in getattr(m, kind).data_points:
                    attrs = {kv.key: kv.value for kv in dp.attributes}
                    t = dp.time_unix_nano
                    if number:
                        value = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
                    else:
                        value = dp.count
                    if attrs is not None and t and value is not None:
                        n += 1
        del resource
    return n


# -- measuring -------------------------------------------------------------------------------


def cpu_rate(fn: Callable[[bytes], object], reqs: list[bytes], points: int) -> float:
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


def make_processor(down: str | None, engine: Any) -> Processor:
    cfg = ProcessorConfig(
        listen="127.0.0.1:0",
        forward=(Downstream(down),) if down else (),
        export_interval_s=3600.0,
        queue_requests=100_000,
        queue_bytes=1 << 34,
    )
    return Processor(cfg, engine=engine, breaker_config=BreakerConfig())


def write_requests(reqs: list[bytes]) -> str:
    with tempfile.NamedTemporaryFile(delete=False) as f:
        for r in reqs:
            f.write(struct.pack("<I", len(r)) + r)
        return f.name


def serve_and_measure(address: str, path: str, finish: Callable[[], object]) -> float:
    """Let a client child send every request in ``path`` to ``address``; CPU seconds of this
    process from the first request until ``finish()`` returns."""
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, address, path, str(AGENTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    time.sleep(0.5)
    c0 = time.process_time()
    client.stdin.write("go\n")
    client.stdin.flush()
    if client.stdout.readline().strip() != "done":
        raise SystemExit("benchmark client failed")
    finish()
    cpu = time.process_time() - c0
    client.wait(10)
    return cpu


def grpc_server(handler: Callable[[bytes, Any], bytes]) -> tuple[grpc.Server, str]:
    """A gRPC server configured like the processor's, with ``handler`` for metrics Export."""
    cfg = ProcessorConfig()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_inflight + 2),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", cfg.max_recv_bytes),
            ("grpc.max_send_message_length", cfg.max_recv_bytes),
        ],
        maximum_concurrent_rpcs=max(64, cfg.max_inflight * 8),
    )
    method = grpc.unary_unary_rpc_method_handler(
        handler, request_deserializer=None, response_serializer=None
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(METRICS_SERVICE, {"Export": method})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def floor_over_grpc(path: str, total: int) -> float:
    server, address = grpc_server(lambda r, c: (generic_decode(r), b"")[1])
    cpu = serve_and_measure(address, path, lambda: None)
    server.stop(0)
    return total / cpu


def processor_over_grpc(path: str, total: int, down: str, engine: Engine) -> tuple[float, Any]:
    served = make_processor(down, engine)
    served.start()
    cpu = serve_and_measure(served.address, path, lambda: served.stop(30))
    return total / cpu, served.stats()["forward"][down]


def engine_alone(reqs: list[bytes], engine: Engine) -> tuple[float, float]:
    """(us per Point, Points per request) of ``engine`` on the Points of ``reqs``."""
    pts: list[Any] = []
    asm = Assembler(lambda s, p: pts.append((s.name, p)), 100_000, 1.0, 1e9)
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    for r in reqs:
        dec.decode(r, asm, time.time_ns())
    asm.flush_due(0.0, all_pending=True)
    c0 = time.process_time()
    for name, p in pts:
        engine.observe(name, p)
    return (time.process_time() - c0) / len(pts) * 1e6, len(pts) / len(reqs)


def _spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):10,.0f}  (min {min(xs):,.0f}, max {max(xs):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400, help="per measured run")
    ap.add_argument("--repeat", type=int, default=5, help="gRPC runs of floor and processor")
    ap.add_argument("--warmup-hours", type=float, default=3.0, help="data fed before measuring")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    steps = max(1, args.requests // AGENTS)
    warm_steps = int(args.warmup_hours * 3600e9 / STEP_NS)
    t0 = int((time.time() - 86400 * 2) * 1e9)
    # Warm-up, one slice for the in-process figures, then one slice per gRPC run: one timeline.
    allreqs = build_requests(warm_steps + steps * (1 + args.repeat), t0)
    cut = warm_steps * AGENTS
    warm, rest = allreqs[:cut], allreqs[cut:]
    n = steps * AGENTS
    slices = [rest[i * n : (i + 1) * n] for i in range(1 + args.repeat)]
    points = count_points(slices[0][0])
    total = n * points
    print(
        f"payload: {n} requests x {points} points ({len(slices[0][0])} bytes each) per run; "
        f"{args.warmup_hours:g} h of data ({len(warm)} requests) fed first"
    )

    reqs = slices[0]
    parse = max(cpu_rate(ExportMetricsServiceRequest.FromString, reqs, points) for _ in range(3))
    print(f"protobuf parse only, in-process:          {parse:12,.0f} points/s")
    generic = max(cpu_rate(generic_decode, reqs, points) for _ in range(2))
    print(f"generic decode (the floor's), in-process: {generic:12,.0f} points/s")

    engine = Engine()
    warmer = make_processor(None, engine)
    for r in warm:
        warmer.export_metrics(METRICS_EXPORT, r)
    warmer.stop(10)

    paths = [write_requests(s) for s in slices]
    recv, down = start_receiver()
    try:
        null = make_processor(down, _NullEngine())
        rate_null = cpu_rate(lambda r: null.export_metrics(METRICS_EXPORT, r), reqs, points)
        null.stop(10)
        print(f"processor in-process, engine left out:    {rate_null:12,.0f} points/s")

        us, per_req = engine_alone(reqs, copy.deepcopy(engine))
        print(f"engine alone: {us:.2f} us per Point ({per_req:.0f} Points per request)")

        inproc = make_processor(down, engine)
        c0 = time.process_time()
        for r in reqs:
            inproc.export_metrics(METRICS_EXPORT, r)
        inproc.stop(30)  # includes draining the forward queue
        rate_inproc = total / (time.process_time() - c0)
        print(f"processor in-process (decode+detect+fwd): {rate_inproc:12,.0f} points/s")

        server, address = grpc_server(lambda r, c: b"")
        rate_transport = total / serve_and_measure(address, paths[1], lambda: None)
        server.stop(0)
        print(f"gRPC do-nothing server (transport only):  {rate_transport:12,.0f} points/s")

        floors: list[float] = []
        rates: list[float] = []
        sent = dropped = calls = 0
        for k in range(args.repeat):
            floors.append(floor_over_grpc(paths[1 + k], total))
            rate, fwd = processor_over_grpc(paths[1 + k], total, down, engine)
            rates.append(rate)
            sent, dropped, calls = (
                sent + fwd["sent"],
                dropped + fwd["dropped"],
                calls + fwd["calls"],
            )
    finally:
        received = stop_receiver(recv)
        for p in paths:
            os.unlink(p)
    floor, rate = statistics.median(floors), statistics.median(rates)
    print(f"decode-only floor over gRPC (baseline):   {_spread(floors)} points/s")
    print(f"processor over gRPC (receive+decode+detect+forward): {_spread(rates)} points/s")
    print(
        f"forwarded {sent} requests in {calls} calls ({dropped} dropped); the downstream "
        f"received {received} calls in all"
    )
    ratio = rate / floor
    print(
        f"ratio to the decode-only floor: {ratio:.3f} (per run: "
        f"{', '.join(f'{r / f:.2f}' for r, f in zip(rates, floors, strict=True))}); "
        f"to the protobuf parse: {rate / parse:.3f}; to the do-nothing server: "
        f"{rate / rate_transport:.3f}  (targets: >= 250,000 points/s, >= 0.60 of the floor)"
    )
    print(
        json.dumps(
            {
                "name": "processor_throughput_grpc",
                "value": round(rate),
                "baseline": round(floor),
                "ratio": round(ratio, 3),
                "unit": "points/s",
            }
        )
    )


if __name__ == "__main__":
    main()
