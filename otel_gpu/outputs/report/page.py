"""The report page: one self-contained HTML file (inline CSS and SVG, no script, no external
URL), so it opens offline, from an e-mail attachment or a CI artifact alike."""

from __future__ import annotations

import html
import time
from typing import Any

from otel_gpu.core import units
from otel_gpu.diagnose import memory
from otel_gpu.outputs.report.plots import activity_figure, memory_figure, to_svg, training_figure
from otel_gpu.outputs.report.replay import Run

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 1040px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: right; }
th:first-child, td:first-child { text-align: left; }
td { white-space: nowrap; }
table.events td, table.events th, table.context td, table.context th { text-align: left; }
table.context td { white-space: normal; }
td.msg { white-space: normal; max-width: 560px; }
.plot svg { width: 100%; height: auto; }
.muted { color: #777; }
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def summary_table(run: Run) -> str:
    rows = []
    for s in run.summary["gpus"] + run.summary["processes"]:
        profile = "-"
        if "busy_fraction" in s:
            profile = (
                f"{units.fraction(s['busy_fraction'])} / {units.fraction(s['idle_fraction'])}"
                f" (mean {units.fraction(s['mean_utilization'])})"
            )
        rows.append(
            "<tr>"
            f"<td>{_esc(s['label'])}</td><td>{units.memory(s['peak_bytes'])}</td>"
            f"<td>{units.memory(s['final_bytes'])}</td>"
            f"<td>{units.rate(s['floor_rate_bytes_per_s'])}</td><td>{_esc(profile)}</td>"
            "</tr>"
        )
    head = "<tr><th></th><th>peak</th><th>final</th><th>floor trend</th><th>busy / idle</th></tr>"
    return f'<table class="summary">{head}{"".join(rows)}</table>'


def alerts_table(run: Run) -> str:
    if not run.alerts and not run.transitions:
        return '<p class="muted">No alert was raised.</p>'
    labels = {s.subject: s.label for s in run.series.values()}
    rows = []
    events: list[tuple[float, str, str, str]] = [
        (a.time, f"{a.kind} alert ({a.severity})", a.subject, a.message) for a in run.alerts
    ] + [
        (t.time, f"breaker {t.from_state} → {t.to_state}", t.subject, t.reason)
        for t in run.transitions
    ]
    for e in run.diagnoses:  # recorded with the live alerts
        if isinstance(e.get("time"), int | float):
            d = e["diagnosis"]
            lines = [str(x) for x in d.get("lines") or []]
            text = " | ".join(lines) or f"no diagnosis: {d.get('error')}"
            events.append(
                (float(e["time"]), f"{e.get('kind')} diagnosis", str(e.get("subject")), text)
            )
    for when, what, subject, text in sorted(events, key=lambda e: e[0]):
        rows.append(
            f"<tr><td>{units.duration(when - run.start)}</td><td>{_esc(what)}</td>"
            f"<td>{_esc(labels.get(subject, subject))}</td>"
            f'<td class="msg">{_esc(text)}</td></tr>'
        )
    head = "<tr><th>at</th><th>event</th><th>subject</th><th>detail</th></tr>"
    return f'<table class="events">{head}{"".join(rows)}</table>'


def context_table(run: Run) -> str:
    """Where, which code, when and how the run ended, from the recording's context lines."""
    c = run.context
    gpus = [s.label for s in run.series.values() if s.subject.startswith("gpu:")]
    revision = c.get("revision")
    if revision:
        revision = str(revision)[:12] + (" (dirty: uncommitted changes)" if c.get("dirty") else "")
        if c.get("ref"):
            revision += f" on {c['ref']}"
    code = c.get("exit_code")
    rows = [
        ("command", c.get("command")),
        ("service", c.get("service")),
        ("revision", revision),
        ("host", c.get("host")),
        ("GPUs", ", ".join(sorted(gpus)) or None),
        ("started", c.get("started")),
        ("ran", units.duration(c["duration_s"]) if c.get("duration_s") is not None else None),
        ("exit code", None if code is None else str(code)),
        (
            "simulated",
            f"yes (--simulate {c['simulated']}: no real GPU was read)"
            if c.get("simulated")
            else None,
        ),
    ]
    shown = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows if v)
    if not shown:
        return '<p class="muted">No run context: a plain trace, not a recording of otel-gpu run or watch.</p>'
    return f'<table class="context">{shown}</table>'


def memory_table(run: Run) -> str:
    """ "Where the memory went": the holders the leak alerts' diagnoses named."""
    labels = {s.subject: s.label for s in run.series.values()}
    rows = []
    for e in run.diagnoses:
        d = e["diagnosis"]
        if d.get("kind") != "memory":
            continue
        subject = str(e.get("subject", ""))
        subject = labels.get(subject, subject)
        holders = [h for h in (d.get("data") or {}).get("holders", []) if h.get("growing")]
        if not holders:
            rows.append(
                f"<tr><td>{_esc(subject)}</td>"
                f'<td class="msg" colspan="4">{_esc(d.get("error") or "nothing found")}</td></tr>'
            )
        for h in holders[:10]:
            rows.append(
                f"<tr><td>{_esc(subject)}</td><td>{_esc(h.get('path'))}</td>"
                f"<td>+{_esc(h.get('growth_count'))}</td>"
                f"<td>+{_esc(memory.size(h.get('growth_bytes') or 0))}</td>"
                f"<td>{_esc(h.get('root'))} in {_esc(h.get('site'))}</td></tr>"
            )
    if not rows:
        return ""
    head = "<tr><th>subject</th><th>holder</th><th>tensors</th><th>bytes</th><th>where</th></tr>"
    return (
        f'<h3>Where the memory went</h3><table class="events memory">{head}{"".join(rows)}</table>'
    )


def run_section(run: Run, index: int) -> str:
    memory = to_svg(memory_figure(run), f"run{index}-memory")
    activity = to_svg(activity_figure(run), f"run{index}-activity")
    progress = training_figure(run)
    training = (
        ""
        if progress is None
        else f'<div class="plot" id="training-{index}">'
        f"{to_svg(progress, f'run{index}-training')}</div>"
    )
    return (
        f'<section class="run"><h2>{_esc(run.name)}</h2>'
        f'<p class="muted">{units.duration(run.end - run.start)} of data, '
        f"{len(run.series)} series, {len(run.alerts)} alerts</p>"
        f"<h3>Run</h3>{context_table(run)}"
        f"<h3>Summary</h3>{summary_table(run)}"
        f'<div class="plot" id="memory-{index}">{memory}</div>'
        f'<div class="plot" id="activity-{index}">{activity}</div>'
        f"{training}"
        f"<h3>Alerts and breaker transitions</h3>{alerts_table(run)}{memory_table(run)}"
        "</section>"
    )


def page(runs: list[Run]) -> str:
    made = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    body = "".join(run_section(run, i) for i, run in enumerate(runs))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>otel-gpu report</title><style>{CSS}</style></head><body>"
        f'<h1>otel-gpu report</h1><p class="muted">{len(runs)} recording(s), made {made}. '
        "Memory in GiB, rates in MB/h; dotted lines are the detector's memory floor, red "
        "lines the fitted leak rate, dashed verticals alerts, triangles breaker transitions, "
        f"shaded bands load / evaluate / save phases.</p>{body}</body></html>"
    )
