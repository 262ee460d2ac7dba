"""The breaker tells the truth: the real engine and breaker on hours of data, a manual clock.

A breaker stays OPEN while a condition that opened it is active (a leak whose floor keeps
rising, a job that stays stalled); probation starts when the condition clears, and "resolved"
(the CLOSED transition, notified by default) means the problem stopped.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.snapshots import GB, STEP, leak_snapshots

from otel_gpu.actions.dispatcher import transition_event
from otel_gpu.agent.watchdog import Watchdog
from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import LEAK, STALL, Alert, Point

pytestmark = pytest.mark.unit

MB_H = 1e6 / 3600  # By/s in one MB/h
NOTIFY_ON = ("open", "closed")  # the default OTEL_GPU_NOTIFY_ON


def leak_memory(warm_h: float, leak_h: float, rate_mb_h: float) -> Callable[[float], float]:
    """Flat for ``warm_h``, rising ``rate_mb_h`` for ``leak_h``, flat again after (with noise)."""
    rng = random.Random(7)

    def used(t: float) -> float:
        leaked = min(max(t - warm_h * 3600, 0.0), leak_h * 3600) * rate_mb_h * MB_H
        return 20 * GB + leaked + rng.uniform(0, 8e6)

    return used


def busy_then(idle_at_h: float, resume_at_h: float | None) -> Callable[[float], float]:
    """Utilization: working, idle from ``idle_at_h`` (memory held), working again at ``resume_at_h``."""

    def util(t: float) -> float:
        idle = t >= idle_at_h * 3600 and (resume_at_h is None or t < resume_at_h * 3600)
        return 0.02 if idle else 0.9

    return util


@dataclass
class Run:
    alerts: list[Alert] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)

    def states(self) -> list[str]:
        return [t.to_state for t in self.transitions]

    def notified(self) -> list[str]:
        return [e for e in map(transition_event, self.transitions) if e in NOTIFY_ON]


def points(hours: float, used: Callable[[float], float], util: Callable[[float], float]):
    t = 0.0
    while t <= hours * 3600:
        u = util(t)
        yield Point(
            time=t,
            used_bytes=used(t),
            limit_bytes=80 * GB,
            util=u,
            procs=1,
            power_w=600.0 if u > 0.5 else 80.0,
            power_limit_w=700.0,
        )
        t += STEP


def drive(samples: Iterator[Point], subject: str = "gpu:GPU-1") -> Run:
    """The agent's order: alerts into the breaker, then time and the active conditions."""
    engine, breaker, run = Engine(), Breaker(BreakerConfig()), Run()
    for p in samples:
        for a in engine.observe(subject, p):
            run.alerts.append(a)
            run.transitions += breaker.record_alert(a)
        run.transitions += breaker.advance(subject, p.time, engine.active_kinds)
    return run


FLAT = leak_memory(0, 0, 0)
BUSY = busy_then(1e9, None)

# name: (hours of data, memory, utilization, breaker states, notifications, problem end (h))
CASES = {
    "a leak that never stops keeps the breaker open for hours": (
        14,
        leak_memory(1, 13, 600),
        BUSY,
        [OPEN],
        ["open"],
        None,
    ),
    "a leak that stops: probation once the floor stopped rising, one resolved": (
        14,
        leak_memory(1, 9, 600),
        BUSY,
        [OPEN, HALF_OPEN, CLOSED],
        ["open", "closed"],
        10,
    ),
    "a stall that never resumes stays open": (
        8,
        FLAT,
        busy_then(2, None),
        [OPEN],
        ["open"],
        None,
    ),
    "a stall that resumes useful work is resolved": (
        8,
        FLAT,
        busy_then(2, 4),
        [OPEN, HALF_OPEN, CLOSED],
        ["open", "closed"],
        4,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_breaker_closes_only_when_the_problem_stopped(name: str) -> None:
    hours, used, util, states, notified, ended_h = CASES[name]
    run = drive(points(hours, used, util))
    assert run.states() == states
    assert run.notified() == notified
    assert len(run.alerts) == 1  # one problem, one alert
    if ended_h is not None:
        probe = next(t for t in run.transitions if t.to_state == HALF_OPEN)
        # probation starts only after the problem ended (and after the cool-down)
        assert probe.time >= ended_h * 3600
        closed = run.transitions[-1]
        assert closed.time == probe.time + BreakerConfig().probation_s
        assert "resolved" in closed.reason


def test_no_alert_on_growth_that_has_ended() -> None:
    """A long leak stops; hours later the longest windows still span mostly growth, but the
    floor has been flat for over an hour: no second alert describing the past."""
    run = drive(points(16, leak_memory(1, 9, 600), BUSY))
    leaks = [a for a in run.alerts if a.kind == LEAK]
    assert len(leaks) == 1 and leaks[0].time < 10 * 3600


def test_a_leak_that_resumes_after_it_was_resolved_is_a_new_episode() -> None:
    used = leak_memory(1, 9, 600)
    rng = random.Random(3)

    def again(t: float) -> float:  # stopped at 10 h, resumes at 12 h, faster
        return used(t) + max(0.0, t - 12 * 3600) * 900 * MB_H + rng.uniform(0, 1e6)

    run = drive(points(20, again, BUSY))
    assert run.states() == [OPEN, HALF_OPEN, CLOSED, OPEN]
    assert [t.episode for t in run.transitions] == [1, 1, 1, 2]
    assert run.notified() == ["open", "closed", "open"]
    assert run.transitions[1].time >= 10 * 3600 and run.transitions[3].time >= 12 * 3600
    assert run.alerts[1].rate_bytes_per_s == pytest.approx(900 * MB_H, rel=0.2)


def _gauges(reader: InMemoryMetricReader) -> dict[str, float]:
    data = reader.get_metrics_data()
    out: dict[str, float] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if p.attributes.get("otel_gpu.subject") == "gpu:GPU-live":
                        out[m.name] = p.value
    return out


def test_leak_rate_and_time_to_exhaustion_follow_the_data_and_go_when_it_clears() -> None:
    """Through the agent's real instruments: the rate follows the current estimate (the leak
    doubles its pace), the time to exhaustion counts down with data time, and both disappear
    once the leak stopped and its condition cleared."""
    reader = InMemoryMetricReader()
    wd = Watchdog(Engine(), Breaker(BreakerConfig()))
    wd.register_instruments(MeterProvider(metric_readers=[reader]).get_meter("t"))

    def rate(t: float) -> float:
        if t > 12 * 3600:
            return 0.0  # the leak stops
        return (600 if t < 6 * 3600 else 1200) * MB_H

    seen: dict[float, dict[str, float]] = {}
    for snap in leak_snapshots(0.0, 16, rate):
        wd.on_snapshot(snap)
        if snap.time % 1800 == 0:
            seen[snap.time / 3600] = _gauges(reader)
    rate_key, eta_key = "otel_gpu.leak.rate", "otel_gpu.memory.time_to_exhaustion"
    assert wd.alerts and wd.alerts[0].kind == LEAK
    first = wd.alerts[0].time / 3600
    # the alert's own eta is not what the gauge shows an hour later: it counts down
    a, b = seen[4.0], seen[5.0]
    assert a[eta_key] - b[eta_key] == pytest.approx(3600, rel=0.25)
    assert a[rate_key] == pytest.approx(600 * MB_H, rel=0.25) and first < 4.0
    # the pace doubled at 6 h: the rate follows the estimate
    assert seen[10.0][rate_key] == pytest.approx(1200 * MB_H, rel=0.25)
    assert seen[10.0][eta_key] < b[eta_key] / 1.5
    # the leak stopped at 12 h: both outputs are gone once the floor is flat, the breaker too
    assert rate_key not in seen[16.0] and eta_key not in seen[16.0]
    assert seen[16.0]["otel_gpu.breaker.state"] == 0
    assert seen[11.5]["otel_gpu.breaker.state"] == 2


def test_breaker_without_conditions_is_time_driven_and_state_keeps_the_held_kinds() -> None:
    """Callers that report no conditions keep the plain cool-down/probation breaker; the kinds
    that hold a breaker open survive a restart through export_state."""
    b = Breaker(BreakerConfig())
    b.record_alert(Alert(STALL, "s", 10.0, "critical", "stalled"))
    b.advance("s", 20.0, lambda _s: {STALL})
    restored = Breaker.from_state(b.export_state())
    assert restored.advance("s", 5000.0, lambda _s: {STALL}) == []  # still stalled: open
    out = restored.advance("s", 6000.0, lambda _s: set())
    assert [t.to_state for t in out] == [HALF_OPEN] and out[0].time == 6000.0
    plain = Breaker(BreakerConfig())
    plain.record_alert(Alert(STALL, "s", 10.0, "critical", "stalled"))
    assert [t.to_state for t in plain.advance("s", 5000.0)] == [HALF_OPEN, CLOSED]


def _alert(t: float, kind: str = LEAK) -> Alert:
    return Alert(kind, "s", t, "critical", f"{kind} at {t:g}")


# events: ("alert", t, kind) or ("tick", t, kinds active now) -> (to_state, time) transitions
CONDITION_CASES = {
    "held past the cool-down: no probe": (
        [("alert", 10, LEAK), ("tick", 11, {LEAK}), ("tick", 5000, {LEAK})],
        [(OPEN, 10)],
    ),
    "cleared after the cool-down: probe from the clearing, close after probation": (
        [("alert", 10, LEAK), ("tick", 11, {LEAK}), ("tick", 2000, set()), ("tick", 2300, set())],
        [(OPEN, 10), (HALF_OPEN, 2000), (CLOSED, 2300)],
    ),
    "cleared within the cool-down: probe when it ends": (
        [("alert", 10, LEAK), ("tick", 11, {LEAK}), ("tick", 100, set()), ("tick", 2000, set())],
        [(OPEN, 10), (HALF_OPEN, 610), (CLOSED, 910)],
    ),
    "the condition returns during probation: re-open": (
        [("alert", 10, LEAK), ("tick", 700, set()), ("tick", 800, {LEAK})],
        [(OPEN, 10), (HALF_OPEN, 610), (OPEN, 800)],
    ),
    "another kind's condition does not hold a breaker it did not open": (
        [("alert", 10, LEAK), ("tick", 11, {STALL}), ("tick", 2000, {STALL})],
        [(OPEN, 10), (HALF_OPEN, 610), (CLOSED, 910)],
    ),
    "an alert while open adds its kind to what holds the breaker": (
        [("alert", 10, LEAK), ("alert", 20, STALL), ("tick", 2000, {STALL})],
        [(OPEN, 10)],
    ),
}


@pytest.mark.parametrize("name", CONDITION_CASES)
def test_breaker_table_with_conditions(name: str) -> None:
    events, expected = CONDITION_CASES[name]
    b, out = Breaker(BreakerConfig()), []
    for what, t, arg in events:
        if what == "alert":
            out += b.record_alert(_alert(t, arg))
        else:
            out += b.advance("s", t, lambda _s, kinds=arg: kinds)
    assert [(x.to_state, x.time) for x in out] == expected
