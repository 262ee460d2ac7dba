"""Text from the outside world made safe to print on a terminal.

Process names (``/proc/PID/exe``, ``comm``: anyone can name a program or a thread), command
lines, GPU names and UUIDs (as the driver reports them) reach the live view, the summary, log
lines and notifications. A terminal obeys what they hold: SGR colours, cursor moves and screen
clears (``ESC [``), window titles and hyperlinks (OSC, ``ESC ]``), and in some terminals worse.
:func:`printable` removes every escape sequence whole, then every remaining control character
(C0, DEL, C1) and the Unicode controls that reorder text (bidi overrides); what is left is
printed as it is.
"""

from __future__ import annotations

import logging
import re

# ESC followed by a CSI (ESC [ params intermediates final), an OSC / DCS / APC / PM / SOS
# string (up to BEL or ESC \, or to the end when cut), or a single character (ESC 7, ESC c).
_ESCAPE = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]?|[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?|[ -~]?)"
    r"|\x9b[0-?]*[ -/]*[@-~]?"  # the one-byte CSI of 8-bit terminals
)
# What is left of the controls: C0 but tab and newline, DEL, C1, and the bidi/line controls.
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
_LINE_BREAKS = re.compile(r"[\t\n]")


def printable(text: str, *, multiline: bool = False) -> str:
    """``text`` with escape sequences and control characters removed. A one-line field (a
    name, a label) also has tabs and newlines turned into spaces; ``multiline`` keeps them
    (a log record with a traceback, a notification body)."""
    if text.isprintable():
        return text  # the common case, one C call (False for any control, tab and newline)
    text = _CONTROL.sub("", _ESCAPE.sub("", text))
    return text if multiline else _LINE_BREAKS.sub(" ", text)


class PrintableFormatter(logging.Formatter):
    """A log formatter whose lines hold no escape sequence (a record may quote a process
    name, a GPU's UUID or an exception's text); tracebacks keep their lines."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), multiline=True)
