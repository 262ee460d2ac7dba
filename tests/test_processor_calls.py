"""Half-open gRPC calls cannot lock the other clients out of the processor (issue 18.5).

Before the fix, 128 calls that sent their headers and never their message held every slot of
gRPC's ``maximum_concurrent_rpcs`` with no deadline: every other client got "Concurrent RPC
limit exceeded" for as long as they were held, with or without ``--token``, and ``/stats`` and
``/healthz`` showed nothing. The attack here is raw HTTP/2 from another local address
(127.0.0.2), against a real processor on 127.0.0.1; the good client is a real gRPC client."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from support.half_open import HalfOpenCalls
from support.otlp_receiver import call
from support.processor import in_process_config
from support.synth import agent_request

from otel_gpu.processor import Processor
from otel_gpu.processor.calls import CallGuard, peer_address
from otel_gpu.processor.wire import METRICS_EXPORT

T0 = int((time.time() - 3600) * 1e9)
TOKEN = "s3cr3t-token-for-the-test"


def request(k: int) -> bytes:
    req = agent_request(T0 + k * 15_000_000_000, gpus=1, processes=1, instance="good")
    return req.SerializeToString()  # type: ignore[no-any-return]


def eventually(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.process
@pytest.mark.parametrize("token", [None, TOKEN], ids=["open", "token"])
def test_128_half_open_calls_leave_other_clients_served_and_are_counted(
    token: str | None,
) -> None:
    cfg = in_process_config(health="127.0.0.1:0", receive_timeout_s=2.0, token=token)
    proc = Processor(cfg)
    proc.start()
    port = int(proc.address.rsplit(":", 1)[1])
    attack = HalfOpenCalls(port, METRICS_EXPORT, connections=4, per_connection=32, token=token)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        # The calls over the per-peer limit are refused at once: the rest wait for a message.
        assert eventually(lambda: attack.ended_count() >= 128 - cfg.max_calls_per_peer), (
            attack.ended_count()
        )
        channel = grpc.insecure_channel(proc.address)
        served = 0
        for k in range(30):
            try:
                call(proc.address, METRICS_EXPORT, request(k), metadata=metadata, timeout=3,
                     channel=channel)  # fmt: skip
                served += 1
            except grpc.RpcError:
                pass
        channel.close()
        assert served >= 29, served
        calls = proc.stats()["calls"]
        assert calls["peer_limited"] == 128 - cfg.max_calls_per_peer
        # The ones held are cancelled at the receive deadline.
        assert eventually(lambda: attack.ended_count() == 128, timeout=10)
        calls = proc.stats()["calls"]
        assert calls["receive_timeouts"] == cfg.max_calls_per_peer
        stats = proc.stats()
        assert stats["signals"]["metrics"]["refused"] == 128  # the self-metric counts them
        assert stats["signals"]["metrics"]["accepted"] == served
        with urllib.request.urlopen(f"http://{proc.health_address}/healthz", timeout=5) as r:
            text = r.read().decode()
        # Said, but still 200: a refused stranger must not get the processor restarted.
        assert r.status == 200 and "calls refused: 112 over the limit of 16 per peer" in text
        assert "16 that sent no message within 2 s" in text
    finally:
        attack.close()
        proc.stop(2)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:10.0.0.5:41234", "10.0.0.5"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:[fe80::1%eth0]:5000", "fe80::1%eth0"),
        ("unix:/run/otel.sock", "unix:/run/otel.sock"),
    ],
)
def test_a_peer_is_its_address_not_its_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address


@pytest.mark.unit
def test_the_per_peer_limit_counts_calls_until_they_leave() -> None:
    guard = CallGuard(per_peer=2, receive_s=5.0)
    assert guard.enter("a") and guard.enter("a") and not guard.enter("a")
    assert guard.enter("b")  # another peer is not held back
    guard.leave("a")
    assert guard.enter("a")
    assert guard.snapshot()["peer_limited"] == 1
    assert guard.problem() is not None and "1 over the limit of 2 per peer" in str(guard.problem())
