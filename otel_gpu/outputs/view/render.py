"""Drawing a :class:`Frame`: a compact table for terminals (rich), one line for logs.

The table is 78 columns wide on an 80-column terminal and grows with a wider one (up to
:data:`MAX_WIDTH`: the model and process names get the room). Colour marks
what needs a look (idle GPU, nearly full memory, an open breaker, a rising floor); rich drops
it when ``NO_COLOR`` is set or the stream is not a terminal.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from otel_gpu.core import units
from otel_gpu.core.printable import printable
from otel_gpu.detect.breaker import HALF_OPEN, OPEN
from otel_gpu.outputs.view.frame import Frame, GpuRow, ProcessRow

WIDTH = 78  # on an 80-column terminal (the least it is drawn for)
MAX_WIDTH = 158
# A floor rising faster than this (By/s, 5 MB/h: the leak detector's minimum rate) is shown.
RISING = 5e6 / 3600


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _state_style(state: str) -> str:
    if state in (OPEN, "failed"):
        return "bold red"
    if state in (HALF_OPEN, "degraded"):
        return "yellow"
    return "green"


def _util_style(util: float | None) -> str:
    if util is None:
        return ""
    return "green" if util >= 0.5 else "yellow" if util >= 0.1 else "red"


def _memory_style(row: GpuRow) -> str:
    if row.used is None or not row.limit:
        return ""
    return "bold red" if row.used >= 0.9 * row.limit else ""


def _trend_style(row: ProcessRow) -> str:
    if row.leaking:
        return "bold red"
    return "yellow" if row.trend is not None and row.trend >= RISING else ""


def header(frame: Frame, title: str) -> Text:
    text = Text(printable(title), style="bold")
    text.append(f"  up {clock(frame.elapsed_s)}")
    if frame.training:
        text.append(f"  {frame.training}")
    elif frame.phase:
        text.append(f"  phase {printable(frame.phase)}")
    if frame.slowed:
        text.append(f"  {slowed_text(frame)}", style="yellow")
    return text


def slowed_text(frame: Frame) -> str:
    """What adaptive sampling slowed, e.g. ``CPU budget: process details every 4 s``."""
    reads = ", ".join(f"{r.replace('_', ' ')} every {s:g} s" for r, s in frame.slowed)
    return f"CPU budget: {reads}"


def breaker_line(frame: Frame) -> Text:
    if not frame.detecting:
        return Text("detection off (--no-detect)", style="dim")
    if not frame.breakers:
        return Text.assemble("breaker ", ("all closed", "green"))
    parts = [f"{n} {state.replace('_', '-')}" for state, n in sorted(frame.breakers.items())]
    style = "bold red" if OPEN in frame.breakers else "yellow"
    text = Text.assemble("breaker ", (", ".join(parts), style))
    if frame.worst:
        text.append(f" ({printable(frame.worst)})")
    return text


def alert_line(frame: Frame) -> Text:
    a = frame.last_alert
    if a is None:
        return Text("last alert: none", style="dim")
    # On the view's own clock (data time since the first sweep), like "up" in the header.
    when = clock(max(0.0, frame.elapsed_s - (frame.time - a.time)))
    style = "bold red" if a.severity == "critical" else "yellow"
    where = a.diagnosis.shown(1) if a.diagnosis is not None else []
    return Text.assemble(
        "last alert ",
        (f"{when} {a.kind}", style),
        printable(f" {frame.last_alert_label or a.subject}: {a.message}"),
        *((printable(f" · where: {where[0]}"),) if where else ()),
    )


def _columns(width: int, *columns: tuple[str, int, str]) -> Table:
    """A borderless table ``width`` wide of one-line columns (name, width, justify), each
    cut with an ellipsis when its text is longer."""
    t = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold", width=width)
    for name, column, justify in columns:
        t.add_column(name, width=column, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    return t


def table(frame: Frame, title: str, width: int = WIDTH) -> RenderableType:
    """The live view: header, GPU rows, process rows, breaker and last alert; ``width``
    columns (from :data:`WIDTH` to :data:`MAX_WIDTH`): the names take what is over 78."""
    width = max(WIDTH, min(MAX_WIDTH, width))
    extra = width - WIDTH
    gpus = _columns(
        width,
        ("GPU", 13, "left"),
        ("model", 14 + extra, "left"),
        ("memory", 15, "right"),
        ("util", 4, "right"),
        ("power", 6, "right"),
        ("temp", 5, "right"),
        ("state", 9, "left"),
    )
    for g in frame.gpus:
        gpus.add_row(
            g.label,
            g.model,
            Text(units.memory_of(g.used, g.limit), style=_memory_style(g)),
            Text(units.fraction(g.util), style=_util_style(g.util)),
            units.watts(g.power_w),
            units.celsius(g.temperature_c),
            Text(g.state.replace("_", "-"), style=_state_style(g.state)),
        )
    procs = _columns(
        width,
        ("PID", 8, "right"),
        ("process", 16 + extra, "left"),
        ("GPU", 5, "left"),
        ("GPU mem", 9, "right"),
        ("floor", 11, "right"),
        ("CPU", 5, "right"),
        ("RSS", 9, "right"),
    )
    for p in frame.processes:
        procs.add_row(
            str(p.pid),
            p.name,
            p.gpu,
            units.memory(p.used),
            Text(units.rate(p.trend), style=_trend_style(p)),
            units.fraction(p.cpu),
            units.memory(p.rss),
        )
    parts: list[RenderableType] = [header(frame, title)]
    if frame.no_gpu_reason:
        parts.append(Text(f"no GPU data: {frame.no_gpu_reason}", style="yellow"))
    parts.append(gpus)
    if frame.hidden_gpus:
        parts.append(Text(f"... {frame.hidden_gpus} more GPUs", style="dim"))
    if frame.processes:
        parts.append(procs)
    else:
        parts.append(Text("no GPU process of the job yet", style="dim"))
    if frame.hidden_processes:
        parts.append(Text(f"... {frame.hidden_processes} more GPU processes", style="dim"))
    parts.append(breaker_line(frame))
    alert = alert_line(frame)
    alert.truncate(width * 2, overflow="ellipsis")
    parts.append(alert)
    return Group(*parts)


def plain_line(frame: Frame, title: str) -> str:
    """One line per interval for logs and pipes: every GPU and GPU process, breaker, alert."""
    parts = [
        f"{printable(title)} up {clock(frame.elapsed_s)}"
        + (
            f" {frame.training}"
            if frame.training
            else (f" phase {printable(frame.phase)}" if frame.phase else "")
        )
    ]
    if frame.slowed:
        parts.append(slowed_text(frame))
    if frame.no_gpu_reason:
        parts.append(f"no GPU data: {frame.no_gpu_reason}")
    for g in frame.gpus:
        parts.append(
            f"{g.label} {units.memory_of(g.used, g.limit)} util {units.fraction(g.util)} "
            f"{units.watts(g.power_w)} {units.celsius(g.temperature_c)} {g.state}"
        )
    for p in frame.processes:
        parts.append(
            f"{p.name} {p.pid} {p.gpu} {units.memory(p.used)} floor {units.rate(p.trend)} "
            f"cpu {units.fraction(p.cpu)} rss {units.memory(p.rss)}"
        )
    parts.append(breaker_line(frame).plain)
    a = frame.last_alert
    if a is not None:
        parts.append(printable(f"last alert {a.kind} {frame.last_alert_label or a.subject}"))
    return " | ".join(parts)
