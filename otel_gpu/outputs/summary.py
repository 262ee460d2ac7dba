"""The end-of-run summary: what a run's GPUs and GPU processes did, in a few lines.

Fed with the same (subject, point) stream the detection engine judges, live (after each sweep)
or from a recording (``otel-gpu report``), so both summaries of one run agree. Per GPU and per
process: peak and final memory and the engine's floor growth rate; per GPU the utilization
profile (busy / idle share of the sampled time, idle meaning under the stall detector's idle
threshold); the alerts raised, breaker transitions and actions taken.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from otel_gpu.core import units
from otel_gpu.core.printable import printable
from otel_gpu.core.private_files import open_private
from otel_gpu.core.redact import redact_value
from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import Alert, Point
from otel_gpu.detect.settings import DetectConfig

# A sample stands for the time until the next one, at most this long (a gap is not busy time).
_MAX_SAMPLE_WEIGHT_S = 60.0
_MAX_ALERTS = 200  # kept for the summary; the rest are counted


@dataclass(slots=True)
class SeriesSummary:
    """One subject's memory and activity over the run."""

    subject: str
    label: str
    first_time: float
    last_time: float
    peak_bytes: float | None = None
    final_bytes: float | None = None
    limit_bytes: float | None = None
    floor_rate_bytes_per_s: float | None = None  # the engine's floor slope at the end
    busy_s: float = 0.0
    idle_s: float = 0.0
    util_seconds: float = 0.0  # integral of utilization over sampled time
    last_util: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "subject": self.subject,
            "label": self.label,
            "peak_bytes": self.peak_bytes,
            "final_bytes": self.final_bytes,
            "limit_bytes": self.limit_bytes,
            "floor_rate_bytes_per_s": self.floor_rate_bytes_per_s,
        }
        sampled = self.busy_s + self.idle_s
        if not self.subject.startswith("process:") and sampled > 0:
            out["busy_fraction"] = self.busy_s / sampled
            out["idle_fraction"] = self.idle_s / sampled
            out["mean_utilization"] = self.util_seconds / sampled
        return out


@dataclass
class RunSummary:
    """Accumulates a run; :meth:`to_dict` / :meth:`render` report it."""

    idle_below: float = DetectConfig().stall_util_idle
    series: dict[str, SeriesSummary] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    alerts_dropped: int = 0
    transitions: list[Transition] = field(default_factory=list)
    # GPU processes the job started that outlived it (agent/leftovers.py), set at its end.
    leftovers: list[dict[str, Any]] = field(default_factory=list)

    def observe(self, subject: str, point: Point, label: str | None = None) -> None:
        """One point as the engine saw it (``rss:`` subjects are host memory: not summarised;
        ``job:`` is the one series of a plain ``analyze`` trace, summarised like a GPU)."""
        if not subject.startswith(("gpu:", "process:", "job:")):
            return
        s = self.series.get(subject)
        if s is None:
            s = self.series[subject] = SeriesSummary(
                subject, label or subject, point.time, point.time
            )
        elif label:
            s.label = label
        dt = min(max(0.0, point.time - s.last_time), _MAX_SAMPLE_WEIGHT_S)
        if s.last_util is not None and dt > 0:
            if s.last_util < self.idle_below:
                s.idle_s += dt
            else:
                s.busy_s += dt
            s.util_seconds += s.last_util * dt
        s.last_util = point.util if point.util is not None and math.isfinite(point.util) else None
        s.last_time = point.time
        used = point.used_bytes
        if used is not None and math.isfinite(used):
            s.final_bytes = used
            s.peak_bytes = used if s.peak_bytes is None else max(s.peak_bytes, used)
        if point.limit_bytes:
            s.limit_bytes = point.limit_bytes

    def on_alert(self, alert: Alert) -> None:
        if len(self.alerts) < _MAX_ALERTS:
            self.alerts.append(alert)
        else:
            self.alerts_dropped += 1

    def on_transition(self, t: Transition) -> None:
        if len(self.transitions) < _MAX_ALERTS:
            self.transitions.append(t)

    def take_trends(self, engine: Engine | None) -> None:
        """Copy the engine's floor slopes (call on the thread that feeds the engine)."""
        if engine is None:
            return
        for subject, s in self.series.items():
            trend = engine.floor_trend(subject)
            if trend is not None and trend.rate is not None:
                s.floor_rate_bytes_per_s = trend.rate

    def to_dict(
        self,
        *,
        duration_s: float | None = None,
        exit_code: int | None = None,
        command: list[str] | None = None,
        actions: dict[str, int] | None = None,
        training: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``training``: the trainers' steps, step rate and phases
        (:meth:`otel_gpu.agent.trainers.TrainerProgress.summary`), None when none answered."""
        series = sorted(self.series.values(), key=lambda s: s.subject)
        return {
            "command": command,
            "duration_s": duration_s,
            "exit_code": exit_code,
            "gpus": [s.to_dict() for s in series if not s.subject.startswith("process:")],
            "processes": [s.to_dict() for s in series if s.subject.startswith("process:")],
            "alerts": [
                {
                    "time": a.time,
                    "kind": a.kind,
                    "subject": a.subject,
                    "label": self._label(a.subject),
                    "severity": a.severity,
                    "message": a.message,
                    "rate_bytes_per_s": a.rate_bytes_per_s,
                    "eta_s": a.eta_s,
                    "diagnosis": diagnosis_record(a),
                }
                for a in self.alerts
            ],
            "alerts_not_listed": self.alerts_dropped,
            "transitions": [
                {"time": t.time, "subject": t.subject, "from": t.from_state, "to": t.to_state}
                for t in self.transitions
            ],
            "actions": actions or {},
            "leftovers": list(self.leftovers),
            "training": training,
        }

    def _label(self, subject: str) -> str:
        s = self.series.get(subject)
        return s.label if s is not None else subject


def write_json(path: str, data: dict[str, Any]) -> None:
    with open_private(path, "w", encoding="utf-8") as fh:  # created 0600
        json.dump(data, fh, indent=2)
        fh.write("\n")


def training_line(training: dict[str, Any] | None) -> str | None:
    """``training: 120 steps, 4.1 steps/s; phases load 3 s, train 25 s``; None without any."""
    if not training:
        return None
    said = []
    if training.get("steps") is not None:
        said.append(f"{training['steps']} steps")
    if training.get("step_rate_per_s") is not None:
        said.append(f"{training['step_rate_per_s']:.3g} steps/s")
    last = training.get("last") or {}
    if last.get("loss") is not None:
        said.append(f"last loss {last['loss']:.4g}")
    phases = training.get("phases_s") or {}
    text = "training: " + (", ".join(said) or "no steps")
    if phases:
        text += "; phases " + ", ".join(
            f"{printable(name)} {units.duration(seconds)}" for name, seconds in phases.items()
        )
    return text


def render(data: dict[str, Any], console: Console) -> None:
    """Print a :meth:`RunSummary.to_dict` as a few lines and one table."""
    head = Text("otel-gpu summary", style="bold")
    if data.get("duration_s") is not None:
        head.append(f"  ran {units.duration(data['duration_s'])}")
    if data.get("exit_code") is not None:
        code = data["exit_code"]
        head.append("  exit code ")
        head.append(str(code), style="green" if code == 0 else "bold red")
    seen = data["gpus"] + data["processes"]
    rows = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    for name, justify in (
        ("", "left"),
        ("peak", "right"),
        ("final", "right"),
        ("floor", "right"),
        ("busy/idle", "right"),
    ):
        rows.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    for s in seen:
        profile = "-"
        if "busy_fraction" in s:
            profile = f"{units.fraction(s['busy_fraction'])}/{units.fraction(s['idle_fraction'])}"
        rows.add_row(
            printable(s["label"]),
            units.memory(s["peak_bytes"]),
            units.memory(s["final_bytes"]),
            units.rate(s["floor_rate_bytes_per_s"]),
            profile,
        )
    lines: list[Any] = [head, rows] if seen else [head, Text("GPUs: none seen", style="dim")]
    training = training_line(data.get("training"))
    if training:
        lines.append(Text(training))
    alerts = data["alerts"]
    lines.append(Text(f"alerts: {len(alerts) + data.get('alerts_not_listed', 0)}"))
    for a in alerts[:5]:
        what = printable(f"  {a['kind']} {a['label']}: {a['message']}")
        lines.append(Text(what, style="yellow"))
        found = a.get("diagnosis") or {}
        for line in (found.get("lines") or [])[:3]:
            lines.append(Text(printable(f"    {line}")))
        if found and not found.get("lines") and found.get("error"):
            lines.append(Text(printable(f"    no diagnosis: {found['error']}"), style="dim"))
    if len(alerts) > 5:
        lines.append(Text(f"  ... {len(alerts) - 5} more (see --summary-json)", style="dim"))
    for left in data.get("leftovers") or ():
        held = "" if left.get("used_bytes") is None else f" {units.memory(left['used_bytes'])}"
        lines.append(
            Text(
                printable(
                    f"still running after the job: {left['name']} (PID {left['pid']}) holds"
                    f"{held} on {left['gpu']}; it was started by the job, end it to free the GPU"
                ),
                style="bold yellow",
            )
        )
    acts = data.get("actions") or {}
    if acts:
        lines.append(
            Text(
                f"actions: {acts.get('notifications_delivered', 0)} notifications sent, "
                f"{acts.get('notifications_failed', 0)} failed, "
                f"stop requested {acts.get('stops_requested', 0)} times"
                + (
                    f", refused {acts['stops_refused']} times (not the job's own problem)"
                    if acts.get("stops_refused")
                    else ""
                )
            )
        )
    console.print(Group(*lines))


def diagnosis_record(alert: Alert) -> dict[str, Any] | None:
    """An alert's diagnosis as JSON (credentials masked), or None when it had none."""
    d = alert.diagnosis
    if d is None:
        return None
    return redact_value(
        {
            "kind": d.kind,
            "lines": list(d.lines),
            "data": dict(d.data),
            "took_s": d.took_s,
            "error": d.error,
        }
    )
