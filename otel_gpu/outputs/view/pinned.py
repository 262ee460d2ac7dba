"""The live view pinned to the bottom rows of the terminal, below the job's own output.

``otel-gpu run`` shares its terminal with the job. A view redrawn in place by moving the cursor
up (rich's ``Live``) would overwrite whatever the job printed in between. Instead, the bottom
rows are taken out of the terminal's scrolling region (DECSTBM, as ``apt`` pins its progress
bar): the job's lines scroll above, untouched, and the view is redrawn in its own rows with the
cursor saved and restored around each drawing. rich renders the frame; the only sequences
written here are the few rich has no API for (scroll region, save and restore cursor).
"""

from __future__ import annotations

from rich.console import Console, RenderableType
from rich.control import Control
from rich.segment import ControlType

_SAVE = "\x1b7"  # DECSC: save cursor position and attributes
_RESTORE = "\x1b8"  # DECRC
_RESET_REGION = "\x1b[r"  # DECSTBM without arguments: the whole screen scrolls again
_ERASE_LINE = str(Control((ControlType.ERASE_IN_LINE, 2)))
# Rows left to the job's output however tall the view gets.
_MIN_JOB_ROWS = 4


def _region(top: int, bottom: int) -> str:
    return f"\x1b[{top};{bottom}r"  # DECSTBM, 1-based inclusive rows


class PinnedRegion:
    """Draws renderables in the bottom rows of ``console``'s terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rows = max(console.size.height, _MIN_JOB_ROWS + 2)
        self.height = 0  # rows reserved so far

    def _write(self, text: str) -> None:
        self.console.file.write(text)
        self.console.file.flush()

    def _reserve(self, height: int) -> None:
        """Grow the pinned rows to ``height``. Newlines from the cursor, then back up, make
        sure the rows below the job's text are free (scrolling it up only when it already
        reaches the bottom); then those rows leave the scrolling region."""
        height = min(height, self.rows - _MIN_JOB_ROWS)
        more = height - self.height
        if more <= 0:
            return
        self._write(
            "\n" * more
            + str(Control((ControlType.CURSOR_UP, more)))
            + _SAVE
            + _region(1, self.rows - height)  # (this homes the cursor: restored next)
            + _RESTORE
        )
        self.height = height

    def draw(self, renderable: RenderableType) -> None:
        rows = max(self.console.size.height, _MIN_JOB_ROWS + 2)
        if rows != self.rows:  # the terminal was resized: pin the view again at its new bottom
            self._write(_SAVE + _RESET_REGION + _RESTORE)
            self.rows, self.height = rows, 0
        with self.console.capture() as capture:
            self.console.print(renderable)
        lines = capture.get().rstrip("\n").split("\n")
        self._reserve(len(lines))
        lines = lines[: self.height]
        top = self.rows - self.height
        out = [_SAVE]
        for i in range(self.height):
            out.append(str(Control.move_to(0, top + i)) + _ERASE_LINE)
            if i < len(lines):
                out.append(lines[i])
        out.append(_RESTORE)
        self._write("".join(out))

    def close(self) -> None:
        """Give the whole screen back to scrolling, with the last view left under the job's
        output and the cursor below it."""
        if self.height:
            self._write(_RESET_REGION + str(Control.move_to(0, self.rows - 1)) + "\n")
            self.height = 0
