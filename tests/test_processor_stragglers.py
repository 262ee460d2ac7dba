"""Stragglers in the processor (issue 22 §2): the ranks' ``training.step.work`` feed their job's
judge, a named rank's alert quotes what the node agent's series say of its GPU and takes the
engine's path (breaker, store, notifications, detector metrics), a job-wide slowdown names no
rank, and the judge's state stays bounded. Encoded requests driven through the pipeline in
process (the real torchrun job: tests/test_straggler_job.py)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from support.processor import in_process_config
from support.synth import add_gpu_facts, agent_request, gpu_uuid, trainer_request

from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.detect.straggler import JOB_SLOWDOWN, STRAGGLER
from otel_gpu.processor.pipeline import Detection
from otel_gpu.processor.store import StateStore
from otel_gpu.processor.wire import LOGS_EXPORT

pytestmark = pytest.mark.unit

T0 = time.time() - 3600
JOB = "otel_gpu.job.id=job-1"
DETECT = DetectConfig(straggler_window_s=10.0)  # 3 of 5 windows of 10 s: named after ~30 s


class Actions:
    def __init__(self) -> None:
        self.transitions: list[Transition] = []

    def on_transition(self, t: Transition) -> None:
        self.transitions.append(t)


def _detection(detect: DetectConfig = DETECT, **config: object):  # type: ignore[no-untyped-def]
    actions = Actions()
    sent: list[tuple[str, bytes]] = []
    store = StateStore(None)
    det = Detection(
        in_process_config(**config),
        Engine(detect),
        Breaker(BreakerConfig(cooldown_s=30.0, probation_s=30.0)),
        store,
        actions,
        lambda m, b: sent.append((m, b)),
    )
    return det, store, actions, sent


Work = Callable[[int, int], float]  # (rank, second) -> work per step


def _run(
    det: Detection,
    seconds: int,
    work: Work,
    *,
    ranks: int = 4,
    gpus: bool = True,
    agent: bool = True,
    seed: int = 0,
) -> None:
    """One export a second from each rank (noisy work) and from the node's agent (its GPUs
    with rank 2's throttled and its PCIe traffic)."""
    rng = random.Random(seed)
    for s in range(seconds):
        t = int((T0 + s) * 1e9)
        for r in range(ranks):
            w = work(r, s) * rng.uniform(0.97, 1.03)
            gpu = gpu_uuid(r) if gpus else None
            det.ingest_metrics(trainer_request(t, rank=r, work_s=w, gpu=gpu).SerializeToString())
        if agent:
            req = agent_request(t, gpus=ranks, processes=0, instance="agent-1")
            add_gpu_facts(req, t, gpu_uuid(2), throttled=("hw_thermal_slowdown",),
                          cleared=("sw_power_cap",), pcie_bytes_per_s=(1.2e9, 3.4e6))  # fmt: skip
            det.ingest_metrics(req.SerializeToString())
    det.tick(final=True)


def _opened(actions: Actions) -> list[Transition]:
    return [t for t in actions.transitions if t.to_state == OPEN]


def test_a_slow_rank_is_named_with_its_gpu_through_the_alert_path() -> None:
    det, store, actions, sent = _detection()
    _run(det, 80, lambda r, s: 0.3 if r == 2 and s >= 20 else 0.1)
    assert store.flush()
    (t,) = _opened(actions)
    a = t.alert
    assert a is not None and a.kind == STRAGGLER and t.subject == f"{JOB} rank 2"
    assert a.evidence["rank"] == 2.0 and a.evidence["gpu"] == gpu_uuid(2)
    assert f"rank 2 (host node-1, GPU {gpu_uuid(2)}) is a straggler" in a.message
    assert "3.0x the job's median" in a.message
    # slow from second 20; named once 3 windows of 10 s were slow
    assert 20 + 30 <= a.time - T0 <= 20 + 40
    assert a.diagnosis is not None and a.diagnosis.kind == STRAGGLER
    (line,) = a.diagnosis.lines
    assert line.startswith(
        f"GPU {gpu_uuid(2)} on host node-1: SM clock 1980 MHz; throttled: hw_thermal_slowdown; "
        "71 °C; 610 W of 700 W; PCIe rx 1.2 GB/s, tx 3.4 MB/s (the node agent's data "
    )
    assert a.evidence["sm_clock_hz"] == 1.98e9 and a.evidence["throttle"] == "hw_thermal_slowdown"
    assert a.evidence["temperature_c"] == 71.0 and a.evidence["pcie_rx_bytes_per_s"] == 1.2e9
    assert det.breaker.state(f"{JOB} rank 2") == OPEN
    stats = det.stats()
    assert (stats.alerts, stats.straggler_jobs, stats.straggler_ranks) == (1, 1, 4)
    # the alert's log record went downstream, under the rank's resource
    logs = [ExportLogsServiceRequest.FromString(b) for m, b in sent if m == LOGS_EXPORT]
    records = [(rl, r) for req in logs for rl in req.resource_logs
               for sl in rl.scope_logs for r in sl.log_records]  # fmt: skip
    alerts = [(rl, r) for rl, r in records if r.event_name == "otel_gpu.alert"]
    ((rl, record),) = alerts
    attributes = {kv.key: kv.value.string_value for kv in record.attributes}
    assert attributes["otel_gpu.alert.kind"] == STRAGGLER
    resource = {kv.key: kv.value for kv in rl.resource.attributes}
    assert resource["service.instance.id"].string_value == "job-1-rank-2"
    store.close()


def test_the_straggler_recovering_resolves_its_breaker() -> None:
    det, store, actions, _sent = _detection()
    _run(det, 260, lambda r, s: 0.3 if r == 2 and 20 <= s < 90 else 0.1)
    assert store.flush()
    moves = [(t.subject, t.to_state) for t in actions.transitions]
    assert moves == [(f"{JOB} rank 2", s) for s in (OPEN, HALF_OPEN, CLOSED)]
    assert det.stats().alerts == 1
    store.close()


def test_without_the_agents_series_or_torchs_the_alert_says_what_it_could_not_see() -> None:
    det, store, actions, _sent = _detection()
    _run(det, 60, lambda r, s: 0.3 if r == 1 else 0.1, agent=False)
    assert store.flush()
    (t,) = _opened(actions)
    assert t.alert is not None and t.alert.diagnosis is not None
    assert t.alert.diagnosis.lines == (
        f"GPU {gpu_uuid(1)} on host node-1: GPU metrics not seen (no node agent's series for "
        "this GPU reach this processor)",
    )
    assert t.alert.evidence["gpu_metrics"] == "not seen"
    det, store, actions, _sent = _detection()
    _run(det, 60, lambda r, s: 0.3 if r == 1 else 0.1, gpus=False)  # a CPU job (gloo)
    assert store.flush()
    (t,) = _opened(actions)
    assert t.alert is not None and t.alert.diagnosis is not None
    assert t.alert.diagnosis.lines[0].startswith("GPU not known on host node-1: the rank reports")
    assert "(host node-1) is a straggler" in t.alert.message
    store.close()


def test_all_ranks_slowing_together_is_one_job_alert_and_no_rank() -> None:
    det, store, actions, _sent = _detection()
    _run(det, 120, lambda r, s: 0.1 if s < 50 else 0.3)
    assert store.flush()
    (t,) = _opened(actions)
    assert t.subject == JOB and t.alert is not None
    assert t.alert.evidence["rule"] == JOB_SLOWDOWN
    assert "the whole job slowed down" in t.alert.message
    store.close()


def test_a_balanced_job_and_a_rank_whose_gauge_stays_at_one_step_name_nobody() -> None:
    det, store, actions, _sent = _detection()
    _run(det, 120, lambda r, s: 0.1)
    assert store.flush() and actions.transitions == []
    store.close()
    # rank 3 ends one slow step and then no more (it hangs): its gauge repeats that step's
    # value at every export, which is one step, judged once, not a straggler in every window
    det, store, actions, _sent = _detection()
    rng = random.Random(1)
    for s in range(240):
        t = int((T0 + s) * 1e9)
        for r in range(4):
            w = 0.5 if r == 3 and s >= 60 else 0.1 * rng.uniform(0.97, 1.03)
            det.ingest_metrics(trainer_request(t, rank=r, work_s=w).SerializeToString())
    det.tick(final=True)
    assert store.flush()
    assert actions.transitions == [] and det.stats().alerts == 0
    store.close()


def test_ranks_are_bounded_per_peer_and_in_all() -> None:
    det, store, actions, _sent = _detection(max_series_per_peer=3)
    _run(det, 60, lambda r, s: 0.3 if r == 3 else 0.1, agent=False)
    stats = det.stats()
    assert (stats.straggler_ranks, stats.straggler_refused) == (3, 60)  # rank 3, each point
    assert det.stats().alerts == 0
    store.close()
    det, store, actions, _sent = _detection(max_series=2)
    _run(det, 10, lambda r, s: 0.1, agent=False, gpus=False)
    assert det.stats().straggler_ranks == 2
    store.close()


def test_turned_off_nothing_is_judged() -> None:
    det, store, actions, _sent = _detection(DetectConfig(straggler_enabled=False))
    _run(det, 60, lambda r, s: 0.3 if r == 2 else 0.1)
    assert store.flush()
    assert actions.transitions == [] and det.stats().straggler_ranks == 0
    store.close()
