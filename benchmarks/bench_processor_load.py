"""`otel-gpu processor` under load with a hostile client: does every well-behaved client's
accepted data arrive, and what does the abuse cost them?

Setup, all on loopback: the processor as a child process (``otel-gpu processor`` with a bearer
token, its default limits, and ``--queue-dir`` unless ``--memory-queue``), forwarding to a strict
downstream child that fully decodes every request (opentelemetry-proto) and records which
requests arrived. In this process: ``--clients`` (32) well-behaved agents, each sending one
collection (2 GPUs, 4 processes: 59 points) every ``--interval`` seconds and, like the OTel
exporters, retrying after the RetryInfo delay when pushed back; in a child process, one hostile
client sending, as fast as the processor answers, in turn: garbage bytes, a request with a
unique 3.5 MB resource, a cardinality bomb (40,000 new ``hw.id`` values in one request) and a
15 MiB request without the token.

Each good request carries its sequence number as a data point of a metric the detectors do not
read, so the downstream can tell exactly which accepted requests arrived (and whether any
arrived twice). Two phases of ``--seconds`` each, a fresh processor each: the good clients
alone (the baseline), then with the hostile client. Printed per phase: good requests accepted
and points/s, p50/p99 latency of accepted calls, refusals, what the hostile client's requests
got, the processor's peak RSS (VmHWM), and delivered vs accepted for the good clients (must be
equal). The JSON line (hostile phase): value delivered, baseline accepted.

    python benchmarks/bench_processor_load.py [--seconds 60] [--clients 32] [--memory-queue]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402
from google.rpc import error_details_pb2  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402
from support.synth import agent_request  # noqa: E402

from otel_gpu.processor.wire import METRICS_EXPORT  # noqa: E402

TOKEN = "bench-token"

DOWNSTREAM = textwrap.dedent(
    """
    import json, sys, threading, grpc
    from collections import Counter
    from concurrent import futures
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest)
    seen = Counter()
    lock = threading.Lock()
    def handle(raw, ctx):
        req = ExportMetricsServiceRequest.FromString(raw)  # strict: every byte decoded
        with lock:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == "bench.seq":
                            for dp in m.gauge.data_points:
                                seen[dp.as_int] += 1
        return b""
    h = grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=None, response_serializer=None)
    s = grpc.server(futures.ThreadPoolExecutor(4),
        options=[("grpc.max_receive_message_length", 64 << 20)])
    s.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(svc, {"Export": h})
        for svc in ("opentelemetry.proto.collector.metrics.v1.MetricsService",
                    "opentelemetry.proto.collector.logs.v1.LogsService")])
    port = s.add_insecure_port(sys.argv[1])
    s.start()
    print(port, flush=True)
    sys.stdin.read()
    print(json.dumps({str(k): v for k, v in seen.items()}), flush=True)
    """
)


def _retry_after(e: grpc.RpcError) -> float:
    for key, value in e.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "google.rpc.retryinfo-bin":
            info = error_details_pb2.RetryInfo.FromString(value)
            return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return 1.0


class GoodClient(threading.Thread):
    def __init__(self, k: int, target: str, interval: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.k, self.interval, self.stop = k, interval, stop
        self.channel = grpc.insecure_channel(target)
        self.call = self.channel.unary_unary(METRICS_EXPORT)
        self.accepted: list[int] = []
        self.latencies: list[float] = []
        self.refused = 0
        self.points = 0

    def request(self, n: int) -> bytes:
        t = time.time_ns() - 60 * 10**9  # data time: a minute ago, advancing
        req = agent_request(t, gpus=2, processes=4, instance=f"good-{self.k}")
        sm = req.resource_metrics[0].scope_metrics[0]
        seq = sm.metrics.add(name="bench.seq")
        seq.gauge.data_points.add(time_unix_nano=t, as_int=self.k * 10**7 + n)
        self.points = sum(len(m.gauge.data_points) + len(m.sum.data_points) for m in sm.metrics)
        return req.SerializeToString()  # type: ignore[no-any-return]

    def run(self) -> None:
        n = 0
        md = (("authorization", f"Bearer {TOKEN}"),)
        while not self.stop.is_set():
            body = self.request(n)
            while not self.stop.is_set():  # as the SDK exporter: retry what was pushed back
                t0 = time.perf_counter()
                try:
                    self.call(body, metadata=md, timeout=10)
                except grpc.RpcError as e:
                    self.refused += 1
                    self.stop.wait(
                        _retry_after(e) if e.code() != grpc.StatusCode.UNAVAILABLE else 1
                    )
                    continue
                self.latencies.append(time.perf_counter() - t0)
                self.accepted.append(self.k * 10**7 + n)
                break
            n += 1
            self.stop.wait(self.interval)


_MARK = b"HOSTILE#"  # 8 bytes replaced in prebuilt payloads, so each request is new


def hostile_payloads() -> list[tuple[str, bytes, bool]]:
    """The attacks, built once: (name, body, sends the token)."""
    t = int((time.time() - 60) * 1e9)
    huge = agent_request(t, gpus=1, processes=1, instance="huge")
    huge.resource_metrics[0].resource.attributes.append(
        KeyValue(key="blob", value=AnyValue(string_value=_MARK.decode() + "x" * 3_500_000))
    )
    bomb = agent_request(t, gpus=1, processes=0, instance="bomb")
    metric = next(
        m
        for m in bomb.resource_metrics[0].scope_metrics[0].metrics
        if m.name == "hw.gpu.memory.usage"
    )
    value = metric.sum.data_points[0].as_int
    for i in range(40_000):
        dp = metric.sum.data_points.add(time_unix_nano=t, as_int=value)
        dp.attributes.append(
            KeyValue(key="hw.id", value=AnyValue(string_value=f"{_MARK.decode()}-{i:05d}"))
        )
    return [
        ("garbage", random.Random(7).randbytes(64 * 1024), True),
        ("huge resource", huge.SerializeToString(), True),
        ("cardinality bomb", bomb.SerializeToString(), True),
        ("15 MiB unauthenticated", b"\x0a" * (15 << 20), False),
    ]


def hostile_main(target: str, seconds: float) -> None:
    """The hostile client, in its own process (so it does not starve the good clients of this
    one's interpreter): each attack in turn, as fast as the processor answers, for
    ``seconds``; prints the outcomes as JSON."""
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary(METRICS_EXPORT)
    attacks = hostile_payloads()
    outcomes: Counter[str] = Counter()
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        name, body, auth = attacks[n % len(attacks)]
        if _MARK in body:  # a new resource, new hw.id values: nothing the caches hold
            body = body.replace(_MARK, b"%08d" % n)
        md = (("authorization", f"Bearer {TOKEN}"),) if auth else ()
        try:
            call(body, metadata=md, timeout=10)
            outcomes[f"{name}: OK"] += 1
        except grpc.RpcError as e:
            outcomes[f"{name}: {e.code().name}"] += 1
        n += 1
    print(json.dumps(outcomes), flush=True)


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    return int(m.group(1)) / 1024 if m else float("nan")


def _stats(health: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{health}/stats", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def run(args: argparse.Namespace, with_hostile: bool) -> tuple[int, int]:
    """One phase: a fresh downstream and processor, the good clients (and the hostile one) for
    ``--seconds``; prints its figures and returns (good requests delivered, accepted)."""
    down = subprocess.Popen(
        [sys.executable, "-c", DOWNSTREAM, "127.0.0.1:0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert down.stdout is not None
    down_addr = f"127.0.0.1:{down.stdout.readline().strip()}"
    qdir = tempfile.mkdtemp(prefix="otel-gpu-bench-queue-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_")}
    env["OTEL_GPU_PROCESSOR_TOKEN"] = TOKEN
    cmd = [sys.executable, "-m", "otel_gpu.cli", "processor", "--listen", "127.0.0.1:0"]
    cmd += ["--forward", down_addr, "--health", "127.0.0.1:0"]
    if not args.memory_queue:
        cmd += ["--queue-dir", qdir]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on ([^\s;]+).*health on http://([^/]+)/", line)
        if m:
            break
    else:
        raise SystemExit("processor did not start:\n" + "".join(lines))
    target, health = m.group(1), m.group(2)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained

    stop = threading.Event()
    good = [GoodClient(k, target, args.interval, stop) for k in range(args.clients)]
    hostile = None
    if with_hostile:
        hostile = subprocess.Popen(
            [sys.executable, __file__, "--hostile", target, "--seconds", str(args.seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
    t0 = time.monotonic()
    for c in good:
        c.start()
    stop.wait(args.seconds)
    stop.set()
    for c in good:
        c.join(15)
    elapsed = time.monotonic() - t0
    outcomes: dict[str, int] = {}
    if hostile is not None:
        out, _ = hostile.communicate(timeout=60)
        outcomes = json.loads(out.strip().splitlines()[-1])

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # let the forward queue drain
        fwd = _stats(health)["forward"][down_addr]
        if fwd["queued"] == 0:
            break
        time.sleep(0.2)
    stats = _stats(health)
    peak = _peak_rss_mib(proc.pid)
    proc.terminate()
    proc.wait(30)
    out, _ = down.communicate("", timeout=30)
    seen = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}

    accepted = [s for c in good for s in c.accepted]
    delivered = sum(1 for s in accepted if seen.get(s, 0) >= 1)
    points_delivered = sum(c.points for c in good for s in c.accepted if seen.get(s, 0) >= 1)
    duplicates = sum(max(0, seen.get(s, 0) - 1) for s in accepted)
    lat = sorted(x for c in good for x in c.latencies)
    points = sum(len(c.accepted) * c.points for c in good)
    p50 = statistics.median(lat) * 1e3 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else float("nan")
    who = "+ 1 hostile" if with_hostile else "alone (baseline)"
    print(f"== {args.clients} good clients {who} for {elapsed:.1f} s; queue: "
          f"{'memory' if args.memory_queue else 'disk (--queue-dir)'}")  # fmt: skip
    print(f"good requests accepted: {len(accepted)} ({len(accepted) / elapsed:.0f}/s, "
          f"{points / elapsed:,.0f} points/s); pushed back and retried: "
          f"{sum(c.refused for c in good)}")  # fmt: skip
    print(f"latency of accepted calls: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    for name, n in sorted(outcomes.items()):
        print(f"hostile {name}: {n}")
    det = stats["detection"]
    print(f"detection: {det['subjects']} subjects, {det['overflow']} overflow points; "
          f"memory limiter: {stats['memory']}")  # fmt: skip
    print(f"processor peak RSS (VmHWM): {peak:.0f} MiB")
    print(f"good requests delivered downstream: {delivered} of {len(accepted)} accepted "
          f"({duplicates} duplicates); points: {points_delivered} of {points} accepted")  # fmt: skip
    print(f"forward: {stats['forward'][down_addr]}")
    return delivered, len(accepted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0, help="duration of each phase")
    ap.add_argument("--clients", type=int, default=32, help="well-behaved clients")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between a client's sends")
    ap.add_argument("--memory-queue", action="store_true", help="without --queue-dir")
    ap.add_argument("--hostile", metavar="TARGET", help=argparse.SUPPRESS)  # the child's mode
    args = ap.parse_args()
    if args.hostile:
        hostile_main(args.hostile, args.seconds)
        return
    run(args, with_hostile=False)  # the baseline: what the good clients get without abuse
    delivered, accepted = run(args, with_hostile=True)
    print(json.dumps({
        "name": "processor_load_good_delivered",
        "value": delivered,
        "baseline": accepted,
        "ratio": round(delivered / accepted, 4) if accepted else 0.0,
        "unit": "requests",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
