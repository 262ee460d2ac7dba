"""Network addresses as users write them: ``HOST:PORT`` for the servers we bind (health,
Prometheus, the processor's listeners) and ``http(s)://HOST[:PORT]/PATH`` for URLs we read."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from otel_gpu.core.errors import UsageError
from otel_gpu.core.redact import mask_url
from otel_gpu.core.settings import refuse

_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?$")


def split_hostport(raw: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) -> (host, port); None when it is not one."""
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0 or raw[end + 1 : end + 2] != ":":
            return None
        host, port_s = raw[1:end], raw[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, sep, port_s = raw.rpartition(":")
        if not sep or not host or ":" in host or not _HOST_RE.match(host):
            return None
    if not port_s.isdigit() or int(port_s) > 65535:
        return None
    return host, int(port_s)


def parse_hostport(
    value: str, setting: str, *, allow_port_zero: bool = True, example: str = "127.0.0.1:4317"
) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) -> (host, port); UsageError naming ``setting``
    (the flag or variable the user set) otherwise. Port 0 (pick a free port) only with
    ``allow_port_zero``."""
    split = split_hostport(str(value).strip())
    if split is None or (split[1] == 0 and not allow_port_zero):
        low = 0 if allow_port_zero else 1
        port = example.rpartition(":")[2]
        refuse(
            setting,
            value,
            f"use HOST:PORT with a port from {low} to 65535, e.g. {example} "
            f"([::1]:{port} for IPv6)",
        )
    return split


def format_hostport(host: str, port: int) -> str:
    """Inverse of :func:`parse_hostport` (brackets IPv6 literals)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_url(url: str, flag: str) -> str:
    """Accept ``http(s)://HOST[:PORT]/PATH`` (an inference server's metrics); UsageError else.
    ``flag``: ``--flag`` or ``VARIABLE=``, as the message shows it."""
    text = url.strip()
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        masked = mask_url(text)  # user:password@ and ?token= are never echoed
        shown = f"{flag}{masked}" if flag.endswith("=") else f"{flag} {masked}"
        raise UsageError(
            f"{shown}: use the server's Prometheus URL, e.g. http://127.0.0.1:8000/metrics"
        )
    return text
