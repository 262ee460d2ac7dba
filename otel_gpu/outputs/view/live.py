"""The live view on stderr, drawn by its own thread.

Why rich: it is widely used and maintained, renders tables to a fixed width with styles,
honours ``NO_COLOR`` and drops styling when the stream is not a terminal. On a terminal the
frame is pinned to the bottom rows (:mod:`otel_gpu.outputs.view.pinned`) so the job's own output keeps
scrolling above it, intact.

The sampler thread only builds a :class:`Frame` (a bounded copy of plain values) and swaps it
in; drawing, and a terminal or pipe that is slow to take the output, cost the view's thread
only, never the sampler or the job. The job's stdout stays untouched: everything goes to
stderr.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from rich.console import Console

from otel_gpu.core.printable import printable
from otel_gpu.detect.model import Alert
from otel_gpu.outputs.sweeps import Sweep
from otel_gpu.outputs.view.frame import Frame, build_frame
from otel_gpu.outputs.view.pinned import PinnedRegion
from otel_gpu.outputs.view.render import MAX_WIDTH, WIDTH, plain_line, table

log = logging.getLogger("otel_gpu.view")

LIVE = "live"  # a table redrawn in place, in the terminal's bottom rows
PLAIN = "plain"  # one line per sweep
OFF = "off"


def choose_mode(quiet: bool, force: bool, is_terminal: bool) -> str:
    """``--quiet`` wins, ``--view`` forces the table, else the table on a terminal only."""
    if quiet:
        return OFF
    if force or is_terminal:
        return LIVE
    return PLAIN


class _Console(Console):
    """rich's Console, minus its reaction to a closed pipe (pointing this process's stdout at
    /dev/null and raising SystemExit): the view just goes silent."""

    def on_broken_pipe(self) -> None:
        self.quiet = True


def make_console(stream: IO[str] | None = None, *, force_terminal: bool = False) -> Console:
    """A console on ``stream`` (default stderr) no wider than the view can use: the
    terminal's width from 80 up to the view's widest."""
    console = _Console(
        file=stream if stream is not None else sys.stderr,
        force_terminal=True if force_terminal else None,
        highlight=False,
        soft_wrap=False,
    )
    console.width = max(WIDTH + 2, min(console.width, MAX_WIDTH + 2))
    return console


class LiveView:
    """Shows the newest frame: redrawn in place (``live``) or one line per sweep (``plain``)."""

    def __init__(
        self,
        mode: str,
        title: str,
        *,
        console: Console | None = None,
        refresh_s: float = 1.0,
    ) -> None:
        self.mode = mode
        self.title = title
        self.console = console if console is not None else make_console(force_terminal=mode == LIVE)
        self._refresh_s = refresh_s
        self._frame: Frame | None = None
        self._drawn: Frame | None = None
        self._started: float | None = None  # data time of the first sweep
        self._last_alert: Alert | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pinned: PinnedRegion | None = None
        # The trainers' phase and step for the title (``phase train  step 1234``), read on the
        # sampler thread when each frame is built; None when no trainer is joined.
        self.training: Callable[[], str | None] | None = None
        self._names: dict[int, str] = {}  # the last frame's process names (sampler thread)

    # -- sampler thread -----------------------------------------------------------------------

    def on_alert(self, alert: Alert) -> None:
        self._last_alert = alert

    def on_sweep(self, sweep: Sweep) -> None:
        if self._started is None:
            self._started = sweep.snapshot.time
        training = self.training() if self.training is not None else None
        self._frame = build_frame(sweep, self._started, self._last_alert, training, self._names)
        self._wake.set()

    # -- the view's thread --------------------------------------------------------------------

    def start(self, first_line: str | None = None) -> LiveView:
        if self.mode == OFF:
            return self
        self._thread = threading.Thread(
            target=self._run, args=(first_line,), name="otel-gpu-view", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, first_line: str | None) -> None:
        try:
            if first_line:  # written here too: a stalled terminal must not hold the caller
                shown = printable(first_line)  # it names the job's program
                self.console.print(shown, markup=False, highlight=False, soft_wrap=True)
            if self.mode == LIVE:
                self._pinned = PinnedRegion(self.console)
            while not self._stop.is_set():
                self._wake.wait()
                self._wake.clear()
                self._draw()
                self._stop.wait(self._refresh_s)  # at most one drawing per refresh_s
            self._draw()
        except Exception:  # a broken terminal must not take anything else down
            log.warning("the live view stopped", exc_info=True)
        finally:
            if self._pinned is not None:
                try:
                    self._pinned.close()
                except Exception:
                    log.debug("closing the live view failed", exc_info=True)

    def _draw(self) -> None:
        frame = self._frame
        if frame is None or frame is self._drawn:
            return
        self._drawn = frame
        if self._pinned is not None:
            self._pinned.draw(table(frame, self.title, self.console.width - 2))
        else:
            line = plain_line(frame, self.title)
            self.console.print(line, markup=False, highlight=False, crop=False, soft_wrap=True)
        self.console.file.flush()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Draw the last frame and leave it on screen; bounded by ``timeout_s``."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    def attach(self, sampler: Any, watchdog: Any) -> LiveView:
        """Feed this view from an agent's sampler (and its watchdog's alerts, if it has one)."""
        from otel_gpu.outputs.sweeps import on_sweeps

        if self.mode == OFF:
            return self
        if watchdog is not None:
            watchdog.alert_listeners.append(self.on_alert)
        on_sweeps(sampler, watchdog, self.on_sweep)
        return self
