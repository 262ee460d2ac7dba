"""A recording replayed for the report: the series as sampled, the engine's floor, the alerts
and breaker transitions the agent would have had, and the run summary.

The replay mirrors the agent's watchdog: each row goes to the engine under its subject, each
alert to the breaker, and after each sweep (the rows sharing one time) the breaker advances to
that time with the engine's active conditions (a leak whose floor still rises holds its breaker
open, as it did live). So the report shows what the live run showed, judged by exactly the same
code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from otel_gpu.detect.breaker import Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import Alert
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.detect.trace import Row, subject_for
from otel_gpu.outputs.summary import RunSummary


@dataclass
class Series:
    """One subject's sampled values (None where unknown) and the engine's floor."""

    subject: str
    label: str
    times: list[float] = field(default_factory=list)
    used: list[float | None] = field(default_factory=list)
    util: list[float | None] = field(default_factory=list)
    power: list[float | None] = field(default_factory=list)
    phase: list[str | None] = field(default_factory=list)
    step: list[float | None] = field(default_factory=list)  # the trainers' (the join's)
    floor_times: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    limit_bytes: float | None = None  # the last memory limit seen (a GPU's total memory)


@dataclass
class Run:
    name: str
    series: dict[str, Series]
    alerts: list[Alert]
    transitions: list[Transition]
    summary: dict[str, Any]
    start: float  # data time of the first row
    end: float
    # The recording's context lines (outputs/record.py): host, revision, command, exit code...
    context: dict[str, Any] = field(default_factory=dict)
    # the diagnosed alerts the recording kept (outputs/record.py: a diagnosis is not replayed)
    diagnoses: list[dict[str, Any]] = field(default_factory=list)


def replay_recording(
    name: str,
    rows: list[Row],
    detect: DetectConfig | None = None,
    breaker_config: BreakerConfig | None = None,
    context: dict[str, Any] | None = None,
) -> Run:
    engine = Engine(detect)
    breaker = Breaker(breaker_config)
    summary = RunSummary(idle_below=engine.config.stall_util_idle)
    series: dict[str, Series] = {}
    alerts: list[Alert] = []
    transitions: list[Transition] = []
    default = subject_for(name)
    sweep_time: float | None = None

    def end_sweep() -> None:
        if sweep_time is not None:
            for t in breaker.advance_all(sweep_time, engine.active_kinds):
                transitions.append(t)
                summary.on_transition(t)

    for row in rows:
        subject = row.subject or default
        p = row.point
        if p.time != sweep_time:
            end_sweep()
            sweep_time = p.time
        s = series.get(subject)
        if s is None:
            s = series[subject] = Series(subject, row.label or subject)
        elif row.label:
            s.label = row.label
        s.times.append(p.time)
        s.used.append(p.used_bytes)
        s.util.append(p.util)
        s.power.append(p.power_w)
        s.phase.append(p.phase)
        s.step.append(p.step)
        if p.limit_bytes is not None:
            s.limit_bytes = p.limit_bytes
        summary.observe(subject, p, row.label)
        for alert in engine.observe(subject, p):
            alerts.append(alert)
            summary.on_alert(alert)
            for t in breaker.record_alert(alert):
                transitions.append(t)
                summary.on_transition(t)
        trend = engine.floor_trend(subject)
        if trend is not None and (not s.floor_times or s.floor_times[-1] != trend.time):
            s.floor_times.append(trend.time)
            s.floor.append(trend.floor)
    end_sweep()
    summary.take_trends(engine)
    start = rows[0].point.time if rows else 0.0
    end = rows[-1].point.time if rows else 0.0
    return Run(
        name=name,
        series=series,
        alerts=alerts,
        transitions=transitions,
        summary=summary.to_dict(duration_s=end - start),
        start=start,
        end=end,
        context=dict(context or {}),
    )
