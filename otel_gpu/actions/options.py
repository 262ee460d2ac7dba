"""How a webhook vendor declares its settings, and the parsers those declarations use.

A vendor's notifier class lists its ``Option``s; the config layer derives from them the setting
names, environment variables and validation, and the notifier derives from them which values
to scrub from logs. Errors name the setting (``where``) but never echo a URL, secret or header
value: they are credentials.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from otel_gpu.actions.redact import redact_url
from otel_gpu.core.errors import UsageError

Parser = Callable[[str, Any], Any]  # (where the value came from, raw value) -> parsed value


@dataclass(frozen=True)
class Option:
    """One vendor setting beside its webhook URL."""

    name: str  # setting name after the vendor's prefix, e.g. "secret" -> dingtalk_secret
    parse: Parser
    secret: bool = False  # a credential: scrubbed from every log line and error
    arg: str = ""  # the notifier's keyword argument; defaults to ``name``

    @property
    def keyword(self) -> str:
        return self.arg or self.name


def webhook_url(where: str, value: Any) -> str:
    """An http(s) URL with a host; shown only as ``scheme://host/…`` when wrong."""
    if not isinstance(value, str):
        raise UsageError(f"{where} must be an http(s) URL string")
    value = value.strip()
    try:
        parts = urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:
        ok = False
    if not ok or any(c.isspace() for c in value):
        raise UsageError(
            f"{where} is not a valid http(s) URL (got {redact_url(value)}); "
            "paste the webhook address exactly as the service shows it"
        )
    return value


def signing_secret(where: str, value: Any) -> str:
    """A non-empty signing secret."""
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where} must be a non-empty string (the signing secret)")
    return value.strip()


def http_headers(where: str, value: Any) -> dict[str, str]:
    """Same format as OTEL_EXPORTER_OTLP_HEADERS: "k1=v1,k2=v2", values percent-decoded; or a
    table of names to values (config file)."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for i, entry in enumerate(value.split(","), 1):
            if not entry.strip():
                continue
            k, sep, v = entry.partition("=")
            if not sep:
                raise UsageError(
                    f"{where}: entry {i} is not key=value; use 'Name=value,Name2=value2'"
                )
            items.append((unquote(k.strip()), unquote(v.strip())))
    else:
        raise UsageError(f"{where} must be 'Name=value,...' or a table of header names to values")
    out: dict[str, str] = {}
    for k, v in items:
        name = str(k)
        if not name or not all(c.isalnum() or c in "-_" for c in name) or not isinstance(v, str):
            raise UsageError(
                f"{where}: header {name!r} needs a name of letters, digits, '-' and a string value"
            )
        if "\n" in v or "\r" in v:
            raise UsageError(f"{where}: the value of header {name!r} contains a line break")
        out[name] = v
    return out


def one_of(*allowed: str) -> Parser:
    """One word out of ``allowed`` (case-insensitive)."""

    def parse(where: str, value: Any) -> str:
        s = str(value).strip().lower()
        if s not in allowed:
            raise UsageError(f"{where}={value!r} is invalid: use {' or '.join(allowed)}")
        return s

    return parse
