"""The report's plots, drawn with matplotlib and returned as inline SVG.

Why matplotlib → SVG: matplotlib is the best-kept Python plotting library and needs no
browser-side code; an SVG is text that sits inside the HTML page, so the report opens offline,
stays sharp at any zoom, and its plots are elements a test can find in the DOM. Figures are
built with the object API (no pyplot global state), so it is safe off the main thread too.
"""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from otel_gpu.core import units
from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN
from otel_gpu.outputs.report.replay import Run, Series

_F = TypeVar("_F", Figure, Figure | None)

PHASE_COLOURS = {"load": "#9ecae1", "evaluate": "#fdd0a2", "save": "#c7e9c0"}
TRANSITION_MARKS = {OPEN: ("^", "#d62728"), HALF_OPEN: ("D", "#ff7f0e"), CLOSED: ("v", "#2ca02c")}

# Labels are process and GPU names, shown as they are: matplotlib would read "$...$" in them as
# mathtext (a name like "run$_$" raises ValueError and the whole report fails). Each Text takes
# this setting (text.parse_math) when it is created, so figures are built and drawn under it.


def _literal_text(build: Callable[[Run], _F]) -> Callable[[Run], _F]:
    @functools.wraps(build)
    def wrapper(run: Run) -> _F:
        with rc_context({"text.parse_math": False}):
            return build(run)

    return wrapper


def _scale(run: Run) -> tuple[float, str]:
    """Seconds per x unit and its name: minutes, or hours for runs over 3 h."""
    return (3600.0, "h") if run.end - run.start > 3 * 3600 else (60.0, "min")


def _x(run: Run, times: Iterable[float]) -> list[float]:
    per, _ = _scale(run)
    return [(t - run.start) / per for t in times]


def phase_bands(run: Run) -> list[tuple[float, float, str]]:
    """(start, end, phase) data-time runs of the load / evaluate / save phases."""
    gpu = next((s for s in run.series.values() if any(s.phase)), None)
    if gpu is None:
        return []
    bands: list[tuple[float, float, str]] = []
    current: str | None = None
    began = 0.0
    for t, phase in zip(gpu.times, gpu.phase, strict=True):
        if phase != current:
            if current in PHASE_COLOURS:
                bands.append((began, t, current))
            current, began = phase, t
    if current in PHASE_COLOURS:
        bands.append((began, gpu.times[-1], current))
    return bands


def _decorate(ax: Axes, run: Run, subjects: set[str]) -> None:
    """Phases as shaded bands, alerts as vertical lines, breaker transitions as markers."""
    seen: set[str] = set()
    for start, end, phase in phase_bands(run):
        x0, x1 = _x(run, (start, end))
        ax.axvspan(x0, x1, color=PHASE_COLOURS[phase], alpha=0.5, lw=0,
                   label=None if phase in seen else f"phase {phase}")  # fmt: skip
        seen.add(phase)
    first = True
    for a in run.alerts:
        if a.subject not in subjects:
            continue
        (x,) = _x(run, (a.time,))
        ax.axvline(x, color="#d62728", lw=1.2, ls="--", label=f"{a.kind} alert" if first else None)
        first = False
    marked: set[str] = set()
    for t in run.transitions:
        if t.subject not in subjects:
            continue
        marker, colour = TRANSITION_MARKS.get(t.to_state, ("o", "black"))
        (x,) = _x(run, (t.time,))
        name = f"breaker {t.to_state.replace('_', '-')}"
        ax.plot([x], [0.02], marker=marker, color=colour, ms=9, ls="none",
                transform=ax.get_xaxis_transform(), clip_on=False,
                label=None if name in marked else name)  # fmt: skip
        marked.add(name)


def _label(ax: Axes, run: Run, ylabel: str, title: str) -> None:
    """A figure's time axis (in the run's unit, the whole run, so that the figures of a run
    line up one above the other), its ``ylabel``, ``title`` and grid."""
    per, unit = _scale(run)
    if run.end > run.start:
        ax.set_xlim(0.0, (run.end - run.start) / per)
    ax.set_xlabel(f"time since start ({unit})")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def _values(s: Series, values: list[float | None], scale: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for t, v in zip(s.times, values, strict=True):
        if v is not None:
            xs.append(t)
            ys.append(v / scale)
    return xs, ys


@_literal_text
def memory_figure(run: Run) -> Figure:
    """GPU memory per process (GiB) with the engine's floor and each leak alert's fitted rate;
    the GPUs' memory when no process holds any."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax = fig.add_subplot()
    # Processes; else the GPUs; else whatever the file holds (a plain analyze trace).
    shown = [s for s in run.series.values() if s.subject.startswith("process:")]
    shown = shown or [s for s in run.series.values() if s.subject.startswith("gpu:")]
    shown = shown or [s for s in run.series.values() if not s.subject.startswith("rss:")]
    for i, s in enumerate(sorted(shown, key=lambda s: s.subject)):
        colour = f"C{i % 10}"
        xs, ys = _values(s, s.used, units.GIB)
        ax.plot(_x(run, xs), ys, color=colour, lw=1.2, label=s.label)
        if s.floor:  # the lower envelope the detector judges: a step under the samples
            ax.plot(_x(run, s.floor_times), [f / units.GIB for f in s.floor], color=colour,
                    lw=2, ls=":", drawstyle="steps-post", label=f"{s.label} floor")  # fmt: skip
        for a in run.alerts:
            if a.subject != s.subject or a.kind != "leak" or a.rate_bytes_per_s is None:
                continue
            floor = float(a.evidence.get("floor_bytes", 0.0))
            window = a.window_s or 0.0
            t0, t1 = a.time - window, run.end
            fit = [floor + a.rate_bytes_per_s * (t - a.time) for t in (t0, t1)]
            ax.plot(_x(run, (t0, t1)), [f / units.GIB for f in fit], color="#d62728", lw=1.5,
                    label=f"fitted leak {units.rate(a.rate_bytes_per_s)}")  # fmt: skip
    for gpu in sorted(run.series.values(), key=lambda s: s.subject):
        if gpu.subject.startswith("gpu:") and gpu.limit_bytes:
            ax.axhline(gpu.limit_bytes / units.GIB, color="#555", lw=1, ls="-.",
                       label=f"{gpu.label} memory limit")  # fmt: skip
    _decorate(ax, run, {s.subject for s in shown} | {s for s in run.series if "gpu:" in s})
    _label(ax, run, "GPU memory (GiB)", "GPU memory per process, floor and fitted leak rate")
    ax.set_ylim(bottom=0)
    _legend_below(fig, ax)
    return fig


def _legend_below(fig: Figure, *axes: Axes) -> None:
    """One legend under the plot, outside the axes, so it covers no data."""
    handles, names = [], []
    for ax in axes:
        more, more_names = ax.get_legend_handles_labels()
        handles += more
        names += more_names
    if handles:
        fig.legend(handles, names, loc="outside lower center", fontsize=7, ncols=4, frameon=False)


@_literal_text
def activity_figure(run: Run) -> Figure:
    """Utilization (%) and power (W) per GPU."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    power_ax = ax.twinx()
    gpus = sorted((s for s in run.series.values() if s.subject.startswith(("gpu:", "job:"))),
                  key=lambda s: s.subject)  # fmt: skip
    for i, s in enumerate(gpus):
        xs, ys = _values(s, s.util, 0.01)
        ax.plot(_x(run, xs), ys, color=f"C{i % 10}", lw=1.2, label=f"{s.label} utilization")
        xs, ys = _values(s, s.power, 1.0)
        power_ax.plot(_x(run, xs), ys, color=f"C{i % 10}", lw=1, ls="--", alpha=0.7,
                      label=f"{s.label} power")  # fmt: skip
    _decorate(ax, run, {s.subject for s in gpus})
    _label(ax, run, "utilization (%)", "GPU utilization and power")
    ax.set_ylim(0, 105)
    power_ax.set_ylabel("power (W)")
    power_ax.set_ylim(bottom=0)
    _legend_below(fig, ax, power_ax)
    return fig


def training_series(run: Run) -> Series | None:
    """The series that carries the trainers' steps (a GPU's; without GPUs, the main
    trainer's host memory: the join writes them there)."""
    return next((s for s in run.series.values() if any(v is not None for v in s.step)), None)


@_literal_text
def training_figure(run: Run) -> Figure | None:
    """The training steps over time and the step rate (steps/s); None without steps."""
    s = training_series(run)
    if s is None:
        return None
    fig = Figure(figsize=(10, 3.0), layout="constrained")
    ax = fig.add_subplot()
    rate_ax = ax.twinx()
    known = [(t, v) for t, v in zip(s.times, s.step, strict=True) if v is not None]
    ax.plot(_x(run, [t for t, _ in known]), [v for _, v in known], color="C0", lw=1.4,
            label="step")  # fmt: skip
    rates_t, rates = [], []
    for (t0, v0), (t1, v1) in zip(known, known[1:], strict=False):
        if t1 > t0:
            rates_t.append(t1)
            rates.append(max(0.0, (v1 - v0) / (t1 - t0)))
    rate_ax.plot(_x(run, rates_t), rates, color="C1", lw=1, ls="--", alpha=0.8,
                 label="steps/s")  # fmt: skip
    _decorate(ax, run, {s.subject})
    _label(ax, run, "global step", "Training progress")
    ax.set_ylim(bottom=0)
    rate_ax.set_ylabel("steps/s")
    rate_ax.set_ylim(bottom=0)
    lines, names = ax.get_legend_handles_labels()
    more, more_names = rate_ax.get_legend_handles_labels()
    ax.legend(lines + more, names + more_names, fontsize=7, loc="upper left", ncols=2)
    return fig


def to_svg(fig: Figure, salt: str) -> str:
    """The figure as an ``<svg>`` element for inline HTML: no XML prolog or DOCTYPE (which
    names an external DTD), text kept as text, ids made unique per figure by ``salt``."""
    buf = io.StringIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": salt, "text.parse_math": False}):
        FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None})
    text = re.sub(r"^.*?(?=<svg)", "", buf.getvalue(), count=1, flags=re.S)
    # The RDF metadata block only names matplotlib (with URLs); the page says what made it.
    return re.sub(r"<metadata>.*?</metadata>", "", text, count=1, flags=re.S)
