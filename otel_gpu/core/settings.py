"""Every setting declared once; one resolver with one precedence.

A :class:`Setting` names a field, its environment variable, its command-line flag (if any), its
parser (which holds the bounds), its default and a one-line doc. :func:`resolve` takes values
from explicit arguments, then the environment, then a config file where one exists, then the
defaults, and reports a bad value as ``SOURCE=value: accepted values`` naming the flag, variable
or file key the user actually used. :func:`add_options` builds argparse options (and their
``--help``) from the same declarations, and :func:`given` reads them back, so a flag's default
is never repeated beside the dataclass's.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from otel_gpu.core.errors import UsageError
from otel_gpu.core.redact import MASK, is_secret_name, mask_url, redact_text

# The one true/false word list (case-insensitive) of every boolean setting.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# A parser turns a raw value (text from a flag or variable, or a typed value from a config
# file or a caller) into the setting's value; ``source`` is what a refusal names.
Parser = Callable[[Any, str], Any]


def refuse(source: str, raw: object, accepted: str) -> NoReturn:
    """Raise the one-line ``SOURCE=value: accepted`` error. The value is shown redacted and
    URL-masked (a secret setting's not at all, but for a file's path): a refusal may be
    printed, logged or kept in a CI log."""
    shown = raw
    if isinstance(raw, str):
        # A secret setting's value is hidden, unless it is the path of a file (a TLS key's).
        path = raw.startswith(("/", "./", "~/")) and not any(c.isspace() for c in raw)
        hidden = is_secret_name(source) and not path
        shown = MASK if hidden else mask_url(redact_text(raw))
    raise UsageError(f"{source}={shown!r}: {accepted}")


def boolean(raw: object, source: str) -> bool:
    """``true``/``false`` (and the other words of TRUE_WORDS / FALSE_WORDS), or a bool."""
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    refuse(source, raw, "use true or false")


def number(
    low: float,
    high: float = math.inf,
    *,
    accepted: str,
    integer: bool = False,
    low_open: bool = False,
    high_open: bool = False,
    scale: float = 1.0,
) -> Parser:
    """A finite number in ``[low, high]`` (open at either end with ``low_open`` /
    ``high_open``), a whole number with ``integer``; the parsed value is multiplied by
    ``scale`` (milliseconds to seconds)."""

    def parse(raw: Any, source: str) -> float | int:
        try:
            # A bool is no number, and a fraction from a config file is no whole number.
            if isinstance(raw, bool) or (
                integer and isinstance(raw, float) and not raw.is_integer()
            ):
                raise ValueError(raw)
            value: float | int = int(raw) if integer else float(raw)
        except (TypeError, ValueError):
            refuse(source, raw, accepted)
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (math.isfinite(value) and above and below):
            refuse(source, raw, accepted)
        return value * scale if scale != 1.0 else value

    return parse


def choice(options: Sequence[str], *, accepted: str | None = None) -> Parser:
    """One of ``options``, case-insensitive (returned in lower case)."""
    said = accepted or f"use one of {', '.join(options)}"

    def parse(raw: object, source: str) -> str:
        word = str(raw).strip().lower()
        if word not in options:
            refuse(source, raw, said)
        return word

    return parse


def text(raw: object, source: str) -> str:
    """Any non-empty text, stripped."""
    value = str(raw).strip()
    if not value:
        refuse(source, raw, "give a value, or unset it")
    return value


@dataclass(frozen=True)
class Setting:
    """One setting: where it is read from, how it is parsed, what it defaults to."""

    name: str  # the field of the settings object it fills
    env: str | None  # environment variable; None: arguments (and files) only
    parse: Parser
    doc: str  # one line, shown in --help and checked against the docs' tables
    default: str = "—"  # the default as the docs and --help show it
    flag: str | None = None  # command-line flag of the commands that take it
    metavar: str | None = None
    # A flag that takes no value and sets this (``--no-detect`` sets detect to False).
    flag_const: object = None
    # Parser for the environment variable when it differs from the flag's (units).
    env_parse: Parser | None = None
    # A flag that may be given more than once; the parser gets the list of its values.
    repeat: bool = False
    # The --help line of a flag that turns the setting off (``--no-detect``), which the doc
    # (what the setting is) would read as the opposite of.
    flag_doc: str | None = None

    def help(self) -> str:
        """The ``--help`` line: the doc, the variable and the default."""
        if self.flag_doc is not None and self.flag_const is False:
            where = f"env {self.env}=false" if self.env else "no variable"
            return f"{self.flag_doc} ({where}; on by default)".replace("%", "%%")
        where = f"env {self.env}, " if self.env else ""
        return f"{self.doc} ({where}default {self.default})".replace("%", "%%")


def read_settings_file(path: str, setting: str, what: str) -> dict[str, Any]:
    """The object of settings in a JSON file, or a TOML file by its ``.toml`` name.

    ``setting`` is the flag or variable that named the file and ``what`` the settings it holds
    (``"action settings"``): every problem is one UsageError naming both, e.g.
    ``--config='d.json': not valid JSON (line 3: Expecting value); use a .toml name for TOML``.
    """
    source = f"{setting}={path!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"{source}: cannot read ({exc.strerror or exc}); point it at a JSON or TOML file of "
            f"{what}"
        ) from None
    doc: Any
    if path.lower().endswith(".toml"):
        try:
            import tomllib  # Python >= 3.11
        except ModuleNotFoundError:
            raise UsageError(f"{source}: TOML needs Python >= 3.11; use JSON") from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{source}: not valid TOML ({exc})") from None
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"{source}: not valid JSON (line {exc.lineno}: {exc.msg}); use a .toml name for "
                "TOML"
            ) from None
    if not isinstance(doc, dict):
        raise UsageError(f"{source}: expected an object of {what}")
    return doc


def resolve(
    declared: Iterable[Setting],
    *,
    env: Mapping[str, str],
    args: Mapping[str, object] | None = None,
    file: Mapping[str, object] | None = None,
    file_name: str = "",
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, origin)`` of every setting given anywhere: argument > environment > file.

    ``args``: field -> value (None = not given), named by the setting's flag in errors;
    ``file``: field -> value read from ``file_name``, named as ``field in FILE``. Settings given
    nowhere are left out (the dataclass default applies). ``origin`` maps each field given to
    the flag, variable or file key it came from, for checks that span settings.
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for s in declared:
        arg = (args or {}).get(s.name)
        raw = env.get(s.env, "").strip() if s.env else ""
        if arg is not None:
            origin[s.name] = s.flag or s.name
            values[s.name] = s.parse(arg, origin[s.name])
        elif raw:
            origin[s.name] = s.env or s.name
            values[s.name] = (s.env_parse or s.parse)(raw, origin[s.name])
        elif file is not None and s.name in file:
            origin[s.name] = f"{s.name} in {file_name}"
            values[s.name] = s.parse(file[s.name], origin[s.name])
    return values, origin


def add_options(
    parser: argparse.ArgumentParser,
    declared: Iterable[Setting],
    defaults: Mapping[str, str] | None = None,
) -> None:
    """An option for each declared setting with a flag. Unset options are None, so the
    environment applies; ``defaults`` (field -> text) are a command's own defaults, which win
    over the environment as arguments do."""
    for s in declared:
        if s.flag is None:
            continue
        if s.flag_const is not None:
            parser.add_argument(
                s.flag, dest=s.name, action="store_const", const=s.flag_const, help=s.help()
            )
            continue
        parser.add_argument(
            s.flag,
            dest=s.name,
            metavar=s.metavar,
            action="append" if s.repeat else "store",
            default=(defaults or {}).get(s.name),
            help=s.help(),
        )


def given(args: argparse.Namespace, declared: Iterable[Setting]) -> dict[str, object]:
    """The values of the options :func:`add_options` built (None where not given)."""
    return {s.name: getattr(args, s.name, None) for s in declared if s.flag is not None}
