"""``/readyz`` verdicts: serving-fatal conditions open a breaker; ready again only after the
cool-down and an alert-free probation (pure, data time)."""

from __future__ import annotations

import pytest

from otel_gpu.core.errors import UsageError
from otel_gpu.detect.breaker import BreakerConfig
from otel_gpu.detect.model import LEAK, STALL, Alert
from otel_gpu.inference.readiness import DEFAULT_FATAL_XIDS, Readiness, ReadinessConfig
from otel_gpu.sampling.snapshot import STATUS_FAILED, STATUS_OK, GpuSample, Snapshot

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0
UUID = "GPU-11111111-2222-3333-4444-555555555555"
BREAKER = BreakerConfig(cooldown_s=10.0, probation_s=20.0)


def _snap(s: float, *, status: str = STATUS_OK, xids: tuple[int, ...] = ()) -> Snapshot:
    return Snapshot(
        time=T0 + s, gpus=(GpuSample(uuid=UUID, index=0, status=status, xid_codes=xids),)
    )


def _leak(s: float, eta: float | None) -> Alert:
    return Alert(LEAK, f"process:7@{UUID}", T0 + s, "critical", "memory leak suspected", eta_s=eta)


def _stall(s: float) -> Alert:
    return Alert(STALL, "server", T0 + s, "critical", "stalled: 3 request(s) waiting")


# Each case: events at seconds of data time ("xid" codes, "lost", "leak" ETA, "stall", or a plain
# sweep), then the expected verdict after each event.
CASES = [
    ("Xid 79 opens, cool-down and probation close",
     [(0, ()), (1, ("xid", 79)), (5, ()), (11, ()), (25, ()), (31, ()), (32, ())],
     [True, False, False, False, False, True, True]),
    ("Xid 13 (an application error) is not serving-fatal",
     [(0, ()), (1, ("xid", 13)), (2, ())], [True, True, True]),
    ("Xid 48 among others", [(0, ("xid", 13, 48)), (5, ())], [False, False]),
    ("a lost GPU holds the replica out until it is back for a probation",
     [(0, ("lost",)), (15, ("lost",)), (40, ("lost",)), (45, ()), (55, ()), (69, ()), (71, ())],
     [False, False, False, False, False, False, True]),
    ("a leak near exhaustion", [(0, ("leak", 300.0)), (5, ())], [False, False]),
    ("a leak with hours to go", [(0, ("leak", 7200.0)), (5, ())], [True, True]),
    ("a leak without a projection", [(0, ("leak", None)), (5, ())], [True, True]),
    ("a serving stall re-opens during probation",
     [(0, ("stall",)), (10, ()), (15, ("stall",)), (25, ()), (46, ())], [False, False, False, False, True]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "events", "ready"), CASES, ids=[c[0] for c in CASES])
def test_readiness_follows_the_serving_fatal_breaker(
    name: str, events: list, ready: list[bool]
) -> None:
    readiness = Readiness(ReadinessConfig(), BREAKER)
    got = []
    for s, event in events:
        kind = event[0] if event else None
        if kind == "leak":
            readiness.on_alert(_leak(s, event[1]))
            readiness.observe(_snap(s))
        elif kind == "stall":
            readiness.observe(_snap(s), [_stall(s)])
        elif kind == "lost":
            readiness.observe(_snap(s, status=STATUS_FAILED))
        elif kind == "xid":
            readiness.observe(_snap(s, xids=tuple(event[1:])))
        else:
            readiness.observe(_snap(s))
        got.append(readiness.verdict()[0])
    assert got == ready


def test_the_reason_names_the_condition_and_the_breaker_state() -> None:
    readiness = Readiness(ReadinessConfig(), BREAKER)
    readiness.observe(_snap(0, xids=(79,)))
    ok, reason = readiness.verdict()
    assert (
        not ok
        and reason
        == f"not ready: GPU {UUID}: Xid 79 (needs a reset: drain / reset the GPU); breaker open"
    )
    readiness.observe(_snap(12))
    assert readiness.verdict()[1].endswith("breaker on probation (half-open)")
    transitions = readiness.observe(_snap(40))
    assert [t.to_state for t in transitions] == ["closed"]
    assert readiness.verdict() == (True, "ready: no serving-fatal condition")


@pytest.mark.parametrize(
    ("env", "xids", "exhaustion"),
    [
        ({}, DEFAULT_FATAL_XIDS, 900.0),
        ({"OTEL_GPU_READY_XIDS": "79, 13"}, frozenset({79, 13}), 900.0),
        ({"OTEL_GPU_READY_XIDS": "none", "OTEL_GPU_READY_EXHAUSTION": "60"}, frozenset(), 60.0),
    ],
)
def test_fatal_xids_and_exhaustion_are_configurable(
    env: dict[str, str], xids: frozenset[int], exhaustion: float
) -> None:
    config = ReadinessConfig.from_env(env)
    assert (config.fatal_xids, config.exhaustion_s) == (xids, exhaustion)
    readiness = Readiness(config, BREAKER)
    readiness.observe(_snap(0, xids=(13,)))
    assert readiness.verdict()[0] == (13 not in xids)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_GPU_READY_XIDS": "79;48"}, "OTEL_GPU_READY_XIDS='79;48': use Xid numbers separated by commas"),
        ({"OTEL_GPU_READY_XIDS": "0"}, "OTEL_GPU_READY_XIDS='0': use Xid numbers"),
        ({"OTEL_GPU_READY_EXHAUSTION": "soon"}, "OTEL_GPU_READY_EXHAUSTION='soon': use a number of seconds"),
        ({"OTEL_GPU_READY_EXHAUSTION": "-5"}, "OTEL_GPU_READY_EXHAUSTION='-5': use a number of seconds"),
    ],
)  # fmt: skip
def test_bad_readiness_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError) as err:
        ReadinessConfig.from_env(env)
    assert str(err.value).startswith(message)
