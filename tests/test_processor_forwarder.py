"""The forwarder survives a long outage under load and cannot die silently (issue 18.1).

Before the fix every ``submit()`` woke the retry wait, so a stream of exports during an outage
turned into a retry storm that reached attempt 1,024 in seconds, where ``0.5 * 2**attempt``
raised ``OverflowError`` and killed the sender thread for good: exports answered OK, none
delivered after the downstream came back, ``/healthz`` "ok"."""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from support.otlp_receiver import call
from support.ports import free_port
from support.processor import in_process_config
from support.strict_downstream import StrictDownstream
from support.synth import agent_request

from otel_gpu.processor import Downstream, Processor
from otel_gpu.processor.queue import MemoryQueue
from otel_gpu.processor.wire import METRICS_EXPORT

T0 = int((time.time() - 3600) * 1e9)


def request(instance: str, k: int) -> bytes:
    req = agent_request(T0 + k * 15_000_000_000, gpus=1, processes=1, instance=instance)
    return req.SerializeToString()  # type: ignore[no-any-return]


def healthz(proc: Processor) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{proc.health_address}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def eventually(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.peers  # an outage of seconds and the downstream's reconnect: > 5 s
def test_a_stream_of_exports_during_an_outage_is_all_delivered_without_a_retry_storm() -> None:
    port = free_port()  # the downstream: down until the stream has run for a while
    cfg = in_process_config(
        forward=(Downstream(f"127.0.0.1:{port}"),),
        forward_retry_s=120.0,
        queue_requests=100_000,
        queue_bytes=1 << 30,
        health="127.0.0.1:0",
    )
    proc = Processor(cfg)
    proc.start()
    down: StrictDownstream | None = None
    accepted = 0
    try:
        channel = grpc.insecure_channel(proc.address)
        outage_end = time.monotonic() + 4.0
        k = 0
        while time.monotonic() < outage_end:
            call(proc.address, METRICS_EXPORT, request("stream", k), channel=channel)
            accepted += 1
            k += 1
        channel.close()
        fwd = proc.stats()["forward"][f"127.0.0.1:{port}"]
        # 4 s of outage is a handful of backoffs (0.5 s doubling), not one retry per export.
        assert accepted > 200 and fwd["retries"] <= 10, (accepted, fwd)
        assert fwd["restarts"] == 0 and proc.forwarders[0]._thread.is_alive()
        down = StrictDownstream(port)  # the outage ends
        assert down.wait_for(lambda: down.count("stream") == accepted, timeout=40), (
            down.count("stream"),
            accepted,
        )
        assert eventually(lambda: proc.stats()["forward"][down.address]["sent"] == accepted)
        assert proc.stats()["forward"][down.address]["dropped"] == 0
        assert healthz(proc)[0] == 200
    finally:
        proc.stop(2)
        if down is not None:
            down.close()


class BrokenQueue(MemoryQueue):
    """A memory queue whose reads fail in a way the sender does not expect while ``broken``
    is set: the fault reaches the sender thread through its real loop."""

    def __init__(self) -> None:
        super().__init__(10_000, 1 << 28)
        self.broken = threading.Event()
        self.faults = 0

    def peek(self, limit: int, max_bytes: int) -> list[tuple[int, str, bytes]]:
        if self.broken.is_set():
            self.faults += 1
            raise RuntimeError("injected queue fault")
        return super().peek(limit, max_bytes)


@pytest.mark.process
def test_a_sender_that_crashes_is_restarted_and_healthz_is_degraded_meanwhile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = StrictDownstream()
    queue = BrokenQueue()
    cfg = in_process_config(forward=(Downstream(down.address),), health="127.0.0.1:0")
    proc = Processor(cfg, queues=lambda _target: queue)
    proc.start()
    try:
        call(proc.address, METRICS_EXPORT, request("before", 0))
        assert down.wait_for(lambda: down.count("before") == 1)
        assert healthz(proc)[0] == 200
        queue.broken.set()
        with caplog.at_level(logging.ERROR, logger="otel_gpu.processor.forward"):
            for k in range(5):
                call(proc.address, METRICS_EXPORT, request("during", k))
            assert eventually(lambda: queue.faults >= 2, timeout=10)
            code, text = healthz(proc)
            assert code == 503 and "forwarder to" in text and "crashed (RuntimeError)" in text
            assert proc.stats()["forward"][down.address]["restarts"] >= 2
        crashes = [r for r in caplog.records if "sender crashed" in r.getMessage()]
        assert len(crashes) == 1 and crashes[0].exc_info is not None  # logged once, with cause
        queue.broken.clear()
        # Restarted (after at most a few seconds of backoff): what was queued is delivered.
        assert down.wait_for(lambda: down.count("during") == 5, timeout=20)
        assert eventually(lambda: healthz(proc)[0] == 200, timeout=5)
        call(proc.address, METRICS_EXPORT, request("after", 0))
        assert down.wait_for(lambda: down.count("after") == 1)
    finally:
        proc.stop(2)
        down.close()
