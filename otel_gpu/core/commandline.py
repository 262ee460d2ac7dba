"""How Python's command line names what it runs: one reading of ``python [options] ...`` for
every place that needs it (the default service name, the ``process.command`` of the
``executable`` mode, a process's role under ``opentelemetry-instrument``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

PYTHON = re.compile(r"^python[0-9.]*$")  # an interpreter's file name: python, python3.11

# The interpreter's options whose value follows, in the same word (-Wignore) or the next.
_VALUE_OPTIONS = "cmWX"
_LONG_WITH_VALUE = frozenset({"--check-hash-based-pycs"})


class PythonTarget(NamedTuple):
    """What ``python ARGS`` runs: ``kind`` is ``script`` (``value`` its path), ``module`` (the
    ``-m`` name), ``code`` (the ``-c`` text) or ``stdin`` (nothing named); ``rest`` is where
    the program's own arguments start in ``ARGS``."""

    kind: str
    value: str
    rest: int


def python_target(args: Sequence[str]) -> PythonTarget:
    """Read the interpreter's options in ``args`` (``argv[1:]`` of a Python process) the way
    CPython does: combined flags (``-uc CODE``), values in the same word or the next."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        word = args[i]
        i += 1
        if word.startswith("--"):  # --version and the like; one long option takes a value
            if word in _LONG_WITH_VALUE:
                i += 1
            continue
        for at, letter in enumerate(word[1:], start=2):
            if letter in _VALUE_OPTIONS:
                value = word[at:]
                if not value and i < len(args):
                    value, i = args[i], i + 1
                if letter == "m":
                    return PythonTarget("module", value, i)
                if letter == "c":
                    return PythonTarget("code", value, i)
                break  # -W / -X: their value is no program
    if i == len(args) or args[i] == "-":
        return PythonTarget("stdin", "", i)
    return PythonTarget("script", args[i], i + 1)
