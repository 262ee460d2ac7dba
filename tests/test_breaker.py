"""Circuit breaker: table-driven, explicit data times, no clock."""

from __future__ import annotations

import json
import math

import pytest

from otel_gpu.core.errors import UsageError
from otel_gpu.detect.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    STATE_VALUES,
    Breaker,
    BreakerConfig,
    Transition,
)
from otel_gpu.detect.model import LEAK, STALL, Alert

pytestmark = pytest.mark.unit

CFG = BreakerConfig(alerts_to_open=1, window_s=300.0, cooldown_s=600.0, probation_s=300.0)
CFG3 = BreakerConfig(alerts_to_open=3, window_s=100.0, cooldown_s=600.0, probation_s=300.0)


def alert(t: float, subject: str = "gpu0", kind: str = LEAK) -> Alert:
    return Alert(kind, subject, t, "critical", f"{kind} at {t:g}", rate_bytes_per_s=1e4, eta_s=3600)


def run(cfg: BreakerConfig, events: list[tuple[str, float]]) -> list[tuple[str, str, float, int]]:
    """events: ("alert", t) or ("tick", t) for subject gpu0 -> (from, to, time, episode) list."""
    b = Breaker(cfg)
    out: list[Transition] = []
    for what, t in events:
        out += b.record_alert(alert(t)) if what == "alert" else b.advance("gpu0", t)
    return [(x.from_state, x.to_state, x.time, x.episode) for x in out]


CASES = {
    "one alert opens at once": (CFG, [("alert", 10)], [(CLOSED, OPEN, 10, 1)]),
    "no alert, no transition": (CFG, [("tick", 10), ("tick", 10_000)], []),
    "full cycle at the due times": (
        CFG,
        [("alert", 10), ("tick", 609), ("tick", 610), ("tick", 909), ("tick", 910)],
        [(CLOSED, OPEN, 10, 1), (OPEN, HALF_OPEN, 610, 1), (HALF_OPEN, CLOSED, 910, 1)],
    ),
    "a late tick reports the due times, both steps at once": (
        CFG,
        [("alert", 10), ("tick", 5000)],
        [(CLOSED, OPEN, 10, 1), (OPEN, HALF_OPEN, 610, 1), (HALF_OPEN, CLOSED, 910, 1)],
    ),
    "alerts while open change nothing (persistent problem, one episode)": (
        CFG,
        [("alert", 10), ("alert", 100), ("alert", 500), ("tick", 609)],
        [(CLOSED, OPEN, 10, 1)],
    ),
    "alert during probation re-opens in the same episode": (
        CFG,
        [("alert", 10), ("tick", 700), ("alert", 800), ("tick", 1399), ("tick", 1400)],
        [
            (CLOSED, OPEN, 10, 1),
            (OPEN, HALF_OPEN, 610, 1),
            (HALF_OPEN, OPEN, 800, 1),
            (OPEN, HALF_OPEN, 1400, 1),
        ],
    ),
    "alert after cool-down without a tick: probe first, then re-open": (
        CFG,
        [("alert", 10), ("alert", 700)],
        [(CLOSED, OPEN, 10, 1), (OPEN, HALF_OPEN, 610, 1), (HALF_OPEN, OPEN, 700, 1)],
    ),
    "alert after the whole cycle starts episode 2": (
        CFG,
        [("alert", 10), ("alert", 2000)],
        [
            (CLOSED, OPEN, 10, 1),
            (OPEN, HALF_OPEN, 610, 1),
            (HALF_OPEN, CLOSED, 910, 1),
            (CLOSED, OPEN, 2000, 2),
        ],
    ),
    "N alerts within the window open": (
        CFG3,
        [("alert", 0), ("alert", 50), ("alert", 99)],
        [(CLOSED, OPEN, 99, 1)],
    ),
    "N alerts spread wider than the window do not": (
        CFG3,
        [("alert", 0), ("alert", 60), ("alert", 120), ("alert", 200)],
        [],
    ),
    "the window slides: the 3rd within 100 s of the 1st still counted": (
        CFG3,
        [("alert", 0), ("alert", 60), ("alert", 120), ("alert", 150)],
        [(CLOSED, OPEN, 150, 1)],
    ),
    "an old alert is judged at the latest time seen": (
        CFG,
        [("alert", 10), ("tick", 2000), ("alert", 5)],
        [
            (CLOSED, OPEN, 10, 1),
            (OPEN, HALF_OPEN, 610, 1),
            (HALF_OPEN, CLOSED, 910, 1),
            (CLOSED, OPEN, 2000, 2),
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_transitions(name: str) -> None:
    cfg, events, expected = CASES[name]
    assert run(cfg, events) == expected


def test_subjects_are_independent_and_advance_all() -> None:
    b = Breaker(CFG)
    assert [t.to_state for t in b.record_alert(alert(0, "gpu0"))] == [OPEN]
    assert [t.to_state for t in b.record_alert(alert(100, "gpu1", STALL))] == [OPEN]
    assert b.state("gpu2") == CLOSED and b.episode("gpu2") == 0
    got = b.advance_all(650)  # gpu0 due at 600, gpu1 at 700
    assert [(t.subject, t.to_state, t.time) for t in got] == [("gpu0", HALF_OPEN, 600)]
    assert (b.state("gpu0"), b.state("gpu1")) == (HALF_OPEN, OPEN)
    assert b.advance("unknown", 10_000) == []


def test_transition_carries_alert_reason_and_episode() -> None:
    b = Breaker(CFG3)
    assert b.record_alert(alert(0)) == []
    assert b.record_alert(alert(10)) == []
    (t,) = b.record_alert(alert(20))
    assert t.alert == alert(20) and t.episode == 1
    assert (
        "gpu0" in t.reason and "3 leak alerts within 100 s" in t.reason and "leak at 20" in t.reason
    )
    (h,) = b.advance("gpu0", 620)
    assert h.alert is None and "10 min" in h.reason
    d = t.to_dict()
    assert json.loads(json.dumps(d))["alert"]["kind"] == LEAK
    with pytest.raises(AttributeError):
        t.time = 5  # type: ignore[misc]  # frozen


def test_export_and_restore_keeps_open_breaker_and_episode() -> None:
    b = Breaker(CFG)
    b.record_alert(alert(10, "gpu0"))
    b.record_alert(alert(20, "gpu1"))
    b.advance_all(700)  # both HALF_OPEN
    b.advance("gpu1", 2000)  # gpu1 CLOSED
    b.record_alert(alert(2100, "gpu1"))  # gpu1 episode 2, OPEN
    snap = json.loads(json.dumps(b.export_state()))  # survives JSON
    r = Breaker.from_state(snap, CFG)
    assert (r.state("gpu0"), r.state("gpu1"), r.episode("gpu1")) == (HALF_OPEN, OPEN, 2)
    # The restored breaker continues exactly like the original.
    assert [(t.subject, t.to_state, t.time) for t in r.advance_all(2800)] == [
        ("gpu0", CLOSED, 910),
        ("gpu1", HALF_OPEN, 2700),
    ]
    assert [(t.subject, t.to_state, t.time) for t in b.advance_all(2800)] == [
        ("gpu0", CLOSED, 910),
        ("gpu1", HALF_OPEN, 2700),
    ]
    # Pending alerts in the window survive too.
    c = Breaker(CFG3)
    c.record_alert(alert(0))
    c.record_alert(alert(10))
    c2 = Breaker.from_state(json.loads(json.dumps(c.export_state())), CFG3)
    assert [t.to_state for t in c2.record_alert(alert(20))] == [OPEN]


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"version": 99, "subjects": {}},
        {"version": 1, "subjects": {"g": {"state": "weird"}}},
        {"version": 1, "subjects": {"g": {"state": "open", "since": "x"}}},
        {"version": 1, "subjects": []},
    ],
)
def test_from_state_rejects_malformed(bad: dict) -> None:
    with pytest.raises(ValueError, match="invalid breaker state"):
        Breaker.from_state(bad)


def test_nan_time_is_ignored_and_forget_resets() -> None:
    b = Breaker(CFG)
    assert b.record_alert(alert(math.nan)) == [] and b.subjects() == []
    b.record_alert(alert(10))
    assert b.advance("gpu0", math.nan) == []
    assert b.record_alert(alert(math.inf)) == []
    assert b.state("gpu0") == OPEN
    assert [t.to_state for t in b.advance("gpu0", 610)] == [HALF_OPEN]  # time still works
    b.forget("gpu0")
    assert b.state("gpu0") == CLOSED and b.subjects() == []
    assert STATE_VALUES[OPEN] > STATE_VALUES[HALF_OPEN] > STATE_VALUES[CLOSED]


def test_config_from_env() -> None:
    env = {
        "OTEL_GPU_BREAKER_ALERTS_TO_OPEN": "3",
        "OTEL_GPU_BREAKER_WINDOW_S": "120",
        "OTEL_GPU_BREAKER_COOLDOWN_S": "60.5",
        "OTEL_GPU_BREAKER_PROBATION_S": "0",
    }
    assert BreakerConfig.from_env(env) == BreakerConfig(3, 120.0, 60.5, 0.0)
    assert BreakerConfig.from_env({}) == BreakerConfig()
    assert BreakerConfig.from_env(env, cooldown_s=1.0).cooldown_s == 1.0  # argument wins


@pytest.mark.parametrize(
    ("var", "value", "accepted"),
    [
        ("OTEL_GPU_BREAKER_ALERTS_TO_OPEN", "0", "integer >= 1"),
        ("OTEL_GPU_BREAKER_ALERTS_TO_OPEN", "1.5", "integer >= 1"),
        ("OTEL_GPU_BREAKER_WINDOW_S", "0", "seconds > 0"),
        ("OTEL_GPU_BREAKER_WINDOW_S", "inf", "seconds > 0"),
        ("OTEL_GPU_BREAKER_COOLDOWN_S", "-1", "seconds >= 0"),
        ("OTEL_GPU_BREAKER_PROBATION_S", "soon", "seconds >= 0"),
    ],
)
def test_config_from_env_errors_name_the_variable(var: str, value: str, accepted: str) -> None:
    with pytest.raises(UsageError) as e:
        BreakerConfig.from_env({var: value})
    assert var in str(e.value) and accepted in str(e.value) and "\n" not in str(e.value)


def test_config_rejects_bad_arguments() -> None:
    with pytest.raises(UsageError, match="alerts_to_open"):
        BreakerConfig(alerts_to_open=0)
    with pytest.raises(UsageError, match="cooldown_s"):
        BreakerConfig(cooldown_s=math.nan)
