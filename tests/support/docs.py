"""The project's reference text: the README (a short front page) and the pages of docs/, which
hold the tables the tests check against the code (settings, metrics, stop kinds, vendors).

Tests read the tables wherever they now live, so a table moved from one page to another stays
checked, and a row that goes missing still fails its test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_HEADING = re.compile(r"^(#{1,6}) (.*)$")


def doc_files() -> list[Path]:
    """README.md, then every page of docs/ in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def reference_lines() -> list[str]:
    """Every line of :func:`doc_files`, a blank line between two files (so that a table at
    the end of one page never runs on into the next)."""
    lines: list[str] = []
    for path in doc_files():
        lines += [*path.read_text(encoding="utf-8").splitlines(), ""]
    return lines


def section(title: str) -> str:
    """The text under the one heading (of any level, in any of :func:`doc_files`) whose title
    is ``title``, up to the next heading of the same or a higher level; the heading line
    first. AssertionError when no heading or more than one has that title."""
    found: list[str] = []
    for path in doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        fenced = False
        start: tuple[int, int] | None = None  # (line, level) of the heading found in this file
        for i, line in enumerate(lines):
            if line.startswith("```"):
                fenced = not fenced
            m = None if fenced else _HEADING.match(line)
            if m is None:
                continue
            level = len(m.group(1))
            if start is not None and level <= start[1]:
                found.append("\n".join(lines[start[0] : i]))
                start = None
            if m.group(2).strip() == title:
                start = (i, level)
        if start is not None:
            found.append("\n".join(lines[start[0] :]))
    assert len(found) == 1, f"{len(found)} headings titled {title!r} in README.md and docs/"
    return found[0]


def first_table(text: str) -> str:
    """The first Markdown table of ``text``: its consecutive lines starting with ``|``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert start is not None, "no table found"
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])
