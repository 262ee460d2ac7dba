"""What the server's queue says about its GPUs: a KV cache filling is not a leak, requests waiting
on idle GPUs are a stall, a full cache with climbing preemptions is a warning (pure, data time)."""

from __future__ import annotations

import pytest

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import LEAK, STALL, THRESHOLD, Point
from otel_gpu.inference.engines import ServerState
from otel_gpu.inference.serving import ServingConditions, ServingConfig

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def _state(
    t: float, *, kv: float | None = 0.3, waiting: float = 0, preempt: float = 0
) -> ServerState:
    return ServerState(
        time=t,
        engine="vllm",
        kv_cache_utilization=kv,
        requests_running=4,
        requests_waiting=waiting,
        preemptions=preempt,
    )


@pytest.mark.parametrize("kv_follows_memory", [True, False])
def test_memory_that_grows_with_the_kv_cache_is_not_a_leak(kv_follows_memory: bool) -> None:
    # 6 h at 1 MB/s on an 80 GB GPU: the leak detector's shape for a slow leak. Served beside a
    # KV cache filling at the same pace it is expected growth; with a flat cache it is a leak.
    engine, serving = Engine(DetectConfig()), ServingConditions()
    alerts = []
    for i in range(6 * 3600 // 5):
        t = T0 + 5.0 * i
        kv = min(1.0, i / 4320) if kv_follows_memory else 0.3
        serving.observe(t, [0.6], _state(t, kv=kv))
        point = Point(
            t, used_bytes=20e9 + 5e6 * i, limit_bytes=80e9, util=0.6, phase=serving.phase()
        )
        alerts += engine.observe("gpu:GPU-a", point)
    kinds = [a.kind for a in alerts]
    assert kinds == ([] if kv_follows_memory else [LEAK])


# (seconds, gpu utils, waiting) steps; expected: when the stall starts and whether it holds at the end
STALL_CASES = [
    ("waiting on idle GPUs", [(0, [0.01, 0.0], 3), (30, [0.01, 0.0], 3), (61, [0.0, 0.0], 2)], [61.0], True),
    ("one GPU busy", [(0, [0.01, 0.7], 3), (61, [0.0, 0.7], 3)], [], False),
    ("idle with no queue", [(0, [0.0], 0), (61, [0.0], 0), (200, [0.0], 0)], [], False),
    ("queue drains then refills", [(0, [0.0], 3), (50, [0.0], 0), (100, [0.0], 3), (150, [0.0], 3)], [], False),
    ("utilization unknown (MIG)", [(0, [None], 3), (61, [None], 3)], [], False),
    ("one episode, one alert", [(0, [0.0], 3), (61, [0.0], 3), (90, [0.0], 3), (120, [0.0], 3)], [61.0], True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "steps", "starts", "holds"), STALL_CASES, ids=[c[0] for c in STALL_CASES]
)
def test_requests_waiting_on_idle_gpus_is_a_stall(
    name: str, steps: list, starts: list[float], holds: bool
) -> None:
    serving = ServingConditions(ServingConfig(stall_s=60.0, idle_util=0.05))
    started_at, active = [], []
    for s, utils, waiting in steps:
        started, active = serving.observe(T0 + s, utils, _state(T0 + s, waiting=waiting))
        started_at += [a.time - T0 for a in started if a.kind == STALL]
    assert started_at == starts
    assert bool([a for a in active if a.kind == STALL]) == holds


def test_no_server_state_claims_no_stall() -> None:
    serving = ServingConditions(ServingConfig(stall_s=60.0))
    serving.observe(T0, [0.0], _state(T0, waiting=3))
    assert serving.observe(T0 + 30, [0.0], None) == ([], [])  # the scrape failed: unknown
    started, _ = serving.observe(T0 + 70, [0.0], _state(T0 + 70, waiting=3))
    assert started == []  # the idle clock restarted at 70 s, not 0 s


PRESSURE_CASES = [
    ("full, waiting, preemptions climbing", [(0.97, 2, 5), (0.98, 2, 9)], 1),
    ("full, waiting, preemptions flat", [(0.97, 2, 5), (0.98, 2, 5)], 0),
    ("preemptions climbing, nobody waiting", [(0.97, 0, 5), (0.98, 0, 9)], 0),
    ("preemptions climbing, cache not full", [(0.80, 2, 5), (0.85, 2, 9)], 0),
    ("one warning per episode", [(0.97, 2, 5), (0.98, 2, 9), (0.99, 2, 12)], 1),
    ("a new episode after the queue drained", [(0.97, 2, 5), (0.98, 2, 9), (0.5, 0, 9), (0.97, 2, 9), (0.98, 2, 14)], 2),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "steps", "warnings"), PRESSURE_CASES, ids=[c[0] for c in PRESSURE_CASES]
)
def test_a_full_kv_cache_with_climbing_preemptions_is_a_warning(
    name: str, steps: list, warnings: int
) -> None:
    serving = ServingConditions()
    got = []
    for i, (kv, waiting, preempt) in enumerate(steps):
        t = T0 + 5 * i
        started, active = serving.observe(
            t, [0.9], _state(t, kv=kv, waiting=waiting, preempt=preempt)
        )
        got += [a for a in started if a.kind == THRESHOLD]
        assert active == []  # an overloaded replica still serves: never serving-fatal
    assert len(got) == warnings
    assert all(a.severity == "warning" and "preemptions climbing" in a.message for a in got)
