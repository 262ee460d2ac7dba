"""The OTLP exporter's settings as the standard ``OTEL_EXPORTER_OTLP_*`` variables give them:
checked before anything starts, and shown without credentials."""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from otel_gpu.core.errors import UsageError


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
    try:
        port = parts.port
    except ValueError:
        port = -1
    digits = parts.netloc.rpartition(":")[2]
    if port in (-1, 0) and digits.isdigit() and parts.hostname:
        raise UsageError(
            f"bad OTLP endpoint {text!r}{named}: port {digits} is out of range; use a port "
            "from 1 to 65535 (for example http://localhost:4317)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or port in (-1, None):
        raise UsageError(
            f"bad OTLP endpoint {text!r}{named}: use http://HOST:PORT or https://HOST:PORT, port "
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


def check_otlp_environment(env: Mapping[str, str]) -> None:
    """Refuse OTLP settings the SDK would misread or fail on later (UsageError, one line)."""
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
