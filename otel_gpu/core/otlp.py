"""The OTLP exporter's settings as the standard ``OTEL_EXPORTER_OTLP_*`` variables give them:
checked before anything starts, and shown without credentials."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from otel_gpu.core.errors import UsageError
from otel_gpu.core.redact import MASK, mask_url

# OTEL_EXPORTER_OTLP_PROTOCOL values the Python SDK has an exporter for (http/json: none).
GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"
HTTP_EXTRA = (
    "pip install '.[otlp-http]' from a clone "
    "(or pip install opentelemetry-exporter-otlp-proto-http)"
)


def otlp_protocol(env: Mapping[str, str], signal: str) -> str:
    """The OTLP protocol for ``signal`` (traces, metrics, logs): the per-signal variable, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else grpc. UsageError (one line) for another value."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = env.get(name, "").strip()
        if not raw:
            continue
        value = raw.lower()
        if value in (GRPC, HTTP_PROTOBUF):
            return value
        raise UsageError(f"{name}={raw!r}: use grpc or http/protobuf (http/json has no exporter)")
    return GRPC


def protocol_variable(env: Mapping[str, str], signal: str) -> str:
    """Which variable set the protocol, for messages."""
    specific = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    return specific if env.get(specific, "").strip() else "OTEL_EXPORTER_OTLP_PROTOCOL"


def shown_endpoint(endpoint: str | None) -> str:
    """The OTLP endpoint as logs and the view show it: scheme, host and port only (a URL may
    carry credentials in its user part or its query)."""
    from urllib.parse import urlsplit

    url = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def check_endpoint(endpoint: str, where: str | None = None) -> str:
    """Accept ``http(s)://host:port`` or ``host:port``; raise UsageError otherwise.

    ``where``: the flag or variable the value came from, named in the message."""
    text = endpoint.strip()
    candidate = text if "://" in text else f"http://{text}"
    parts = urlsplit(candidate)
    named = f" ({where})" if where else ""
    shown = mask_url(text)  # user:password@ and ?token= are never echoed
    try:
        port = parts.port
    except ValueError:
        port = -1
    digits = parts.netloc.rpartition(":")[2]
    if port in (-1, 0) and digits.isdigit() and parts.hostname:
        raise UsageError(
            f"bad OTLP endpoint {shown!r}{named}: port {digits} is out of range; use a port "
            "from 1 to 65535 (for example http://localhost:4317)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or port in (-1, None):
        raise UsageError(
            f"bad OTLP endpoint {shown!r}{named}: use http://HOST:PORT or https://HOST:PORT, port "
            "included (for example http://localhost:4317)"
        )
    return text


# The SDK reads these files only when it opens a TLS channel, and logs a traceback for a
# missing one while the job runs on unexported; they are checked before anything starts.
_OTLP_FILES = (
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
)
# The SDK takes anything but "true" (any case) as false, so a typo silently turns TLS on.
_OTLP_FLAGS = ("OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_METRICS_INSECURE")


# Every variable the OTLP exporters read headers from (the general one and per signal).
HEADER_VARIABLES = tuple(
    f"OTEL_EXPORTER_OTLP_{s}HEADERS" for s in ("", "METRICS_", "TRACES_", "LOGS_")
)
# What the SDK accepts in them (opentelemetry.util.re, "liberal": values may hold spaces):
# NAME=VALUE entries separated by commas. An entry that does not match is logged by the SDK in
# full ("Header format invalid! ... <entry>", the credential with it) and dropped, so the
# exports then go without it (without authentication).
_HEADER_ENTRY = re.compile(
    r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*="
    r"[ \t]*[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*[ \t]*"
)
_HEADER_DELIMITER = re.compile(r"[ \t]*,[ \t]*")
_HEADER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,39}")


def _masked_entry(entry: str) -> str:
    """An entry as an error shows it: its name and separator when it reads like a header
    name (``authorization:***``), else only ``***``; never the value."""
    text = entry.strip()
    m = _HEADER_NAME.match(text)
    if m is None or m.end() == len(text) or text[m.end()] not in "=: \t":
        return MASK  # a bare value (the token alone?) or something unreadable: show nothing
    return f"{m.group()}{text[m.end()]}{MASK}"


def check_headers(name: str, value: str) -> None:
    """Refuse a header list the SDK would half-drop (UsageError naming the entry, masked)."""
    for i, entry in enumerate(_HEADER_DELIMITER.split(value), 1):
        if entry and not _HEADER_ENTRY.fullmatch(entry.strip()):
            raise UsageError(
                f"{name}: entry {i} ({_masked_entry(entry)!r}) is not NAME=VALUE with a "
                "URL-encoded value, so the exporter would drop it and export without it: "
                "separate entries with commas and URL-encode values, quotes, ';' and '\\' "
                "included (e.g. authorization=Bearer%20TOKEN)"
            )


def check_otlp_environment(env: Mapping[str, str]) -> None:
    """Refuse OTLP settings the SDK would misread or fail on later (UsageError, one line)."""
    for name in HEADER_VARIABLES:
        if env.get(name):
            check_headers(name, env[name])
    for name in _OTLP_FLAGS:
        value = env.get(name)
        if value is not None and value.lower() not in ("true", "false"):
            raise UsageError(f"{name}={value!r}: use true (plain gRPC) or false (TLS)")
    for name in _OTLP_FILES:
        path = env.get(name)
        if path and not os.access(path, os.R_OK):
            problem = "no such file" if not os.path.exists(path) else "not readable"
            raise UsageError(
                f"{name}={path}: {problem}; give the path of a readable PEM file, or unset it"
            )
