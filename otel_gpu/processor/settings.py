"""Settings of the OTLP processor service: each declared once, resolved once.

:data:`DECLARED` holds every setting the ``otel-gpu processor`` command takes (field, flag,
``OTEL_GPU_PROCESSOR_*`` variable, parser with its bounds, shown default, one-line doc); its
options, ``--help`` and the table in docs/processor.md derive from it. :meth:`ProcessorConfig.load` resolves
them (flag > variable > default) and refuses a bad value with one :class:`UsageError` line
naming the flag or variable used. Direct construction (tests, embedders) is held to the same
bounds, each refusal naming the field.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.core.addresses import format_hostport, parse_hostport, split_hostport
from otel_gpu.core.errors import UsageError
from otel_gpu.core.redact import redact_text
from otel_gpu.core.settings import Parser, Setting, number, refuse, resolve, text

_MIB = 1024 * 1024
# gRPC takes its message size limits as a C int.
_GRPC_MAX_BYTES = 2**31 - 1


@dataclass(frozen=True)
class Downstream:
    """One forwarding target: a gRPC target string and whether to use TLS."""

    target: str  # host:port as grpc expects it
    tls: bool = False

    @classmethod
    def parse(cls, value: str, source: str = "--forward") -> Downstream:
        """``HOST:PORT``, ``http://HOST:PORT`` (plaintext) or ``https://HOST:PORT`` (TLS)."""
        raw = value.strip()
        tls = False
        for scheme, is_tls in (("http://", False), ("https://", True), ("grpc://", False)):
            if raw.lower().startswith(scheme):
                raw, tls = raw[len(scheme) :].rstrip("/"), is_tls
                break
        split = split_hostport(raw)
        if split is None or split[1] == 0:
            refuse(
                source,
                redact_text(value),  # http://user:password@host:port: never echoed as given
                "use HOST:PORT, http://HOST:PORT or https://HOST:PORT (TLS) with a port from 1 "
                "to 65535, e.g. otelcol:4317",
            )
        return cls(format_hostport(*split), tls)


# --- parsers: the flag's or variable's text, or a field's value (direct construction) ---------


def _address(raw: object, source: str) -> str:
    address = str(raw).strip()
    parse_hostport(address, source)
    return address


def _forward(raw: object, source: str) -> tuple[Downstream, ...]:
    """Comma-separated (the variable), repeated (the flag, a list) or already Downstreams."""
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    out: list[Downstream] = []
    for item in items:
        if isinstance(item, Downstream):
            out.append(item)
            continue
        # A blank value (``--forward "$UNSET"``) is refused, not read as "forward nowhere".
        parts = [x for x in str(item).split(",") if x.strip()] or [str(item)]
        out.extend(Downstream.parse(x, source) for x in parts)
    return tuple(out)


def _token(raw: object, source: str) -> str:
    token = str(raw)
    if not token or any(c.isspace() for c in token):
        # The value is a credential: it is never echoed.
        raise UsageError(f"{source}: use a non-empty token without whitespace (value not shown)")
    return token


def _pem(raw: object, source: str) -> str:
    path = text(raw, source)
    if not os.access(path, os.R_OK):
        problem = "no such file" if not os.path.exists(path) else "not readable"
        refuse(source, raw, f"{problem}; give the path of a readable PEM file")
    return path


_MEMORY_LIMIT = "use 0 (off) or a whole number of MiB, 64 or more"
_WHOLE_MIB = number(0, integer=True, accepted=_MEMORY_LIMIT)


def _memory_limit(raw: object, source: str) -> int:
    mib = int(_WHOLE_MIB(raw, source))
    if 0 < mib < 64:  # too little for the processor itself: it would refuse every export
        refuse(source, raw, _MEMORY_LIMIT)
    return mib


def _in_bytes(parse: Parser) -> Parser:
    """A size given in MiB, kept in bytes."""
    return lambda raw, source: int(parse(raw, source) * _MIB)


# At most a day: a larger delay or timeout means nothing here, and past ~1e11 s it no longer
# fits a gRPC Duration (a push-back would fail) or a thread wait (OverflowError).
_SECONDS = number(
    0, 86400, low_open=True, accepted="use a positive number of seconds, at most 86400 (a day)"
)
_COUNT = number(1, integer=True, accepted="use a whole number, 1 or more")
_BYTES = number(
    1024, _GRPC_MAX_BYTES, integer=True, accepted="use a whole number of bytes, 1024 or more"
)

# Every setting of `otel-gpu processor`, declared once (docs/processor.md lists
# them; a test checks the table against these). Fields of ProcessorConfig.
DECLARED = (
    Setting(
        "listen", "OTEL_GPU_PROCESSOR_LISTEN", _address,
        "gRPC address to serve; containers pass 0.0.0.0:4317, port 0 picks a free one",
        "127.0.0.1:4317", "--listen", "HOST:PORT",
    ),
    Setting(
        "forward", "OTEL_GPU_PROCESSOR_FORWARD", _forward,
        "downstream OTLP gRPC endpoints, comma-separated or the flag repeated; "
        "`https://HOST:PORT` for TLS", "none", "--forward", "HOST:PORT", repeat=True,
    ),
    Setting(
        "state_path", "OTEL_GPU_PROCESSOR_STATE", text,
        "SQLite file keeping breaker state and alert history across restarts", "in memory",
        "--state", "FILE",
    ),
    Setting(
        "tls_cert", "OTEL_GPU_PROCESSOR_TLS_CERT", _pem,
        "serve TLS with this PEM certificate chain; give its key too", "off", "--tls-cert", "PEM",
    ),
    Setting(
        "tls_key", "OTEL_GPU_PROCESSOR_TLS_KEY", _pem, "PEM private key of the TLS certificate",
        "—", "--tls-key", "PEM",
    ),
    Setting(
        "token", "OTEL_GPU_PROCESSOR_TOKEN", _token,
        "clients must send `authorization: Bearer TOKEN` (else UNAUTHENTICATED); prefer the "
        "variable: arguments are visible in ps", "off", "--token", "TOKEN",
    ),
    Setting(
        "health", "OTEL_GPU_PROCESSOR_HEALTH", _address,
        "serve HTTP `/healthz`, `/livez`, `/readyz` and `/stats` here", "off", "--health",
        "HOST:PORT",
    ),
    Setting(
        "prometheus", "OTEL_GPU_PROCESSOR_PROMETHEUS", _address,
        "serve the detector metrics and the processor's own metrics as Prometheus `/metrics` "
        "here (see Deploy)", "off", "--prometheus",
        "HOST:PORT",
    ),
    Setting(
        "queue_dir", "OTEL_GPU_PROCESSOR_QUEUE_DIR", text,
        "keep each downstream's forward queue on disk in this directory: data accepted during "
        "an outage survives a restart (even kill -9)", "in memory", "--queue-dir", "DIR",
    ),
    Setting(
        "queue_dir_bytes", None,
        _in_bytes(number(1, integer=True, accepted="use a whole number of MiB, 1 or more")),
        "disk queue size per downstream, MiB; while it is full, exports are refused with a "
        "retry delay", "1024", "--queue-dir-mib", "MIB",
    ),
    Setting(
        "stall_after_s", None, _SECONDS,
        "`/healthz` fails when no request was accepted for this many seconds after the first "
        "one", "300", "--stall-after", "SECONDS",
    ),
    Setting(
        "max_series", None, _COUNT,
        "detection subjects tracked at once; more are counted as overflow", "20000",
        "--max-series", "N",
    ),
    Setting(
        "max_series_per_reporter", None, _COUNT,
        "detection subjects one reporter (one resource identity) may hold, so one client "
        "cannot take the slots of everyone", "2000", "--max-series-per-reporter", "N",
    ),
    Setting(
        "max_series_per_peer", None, _COUNT,
        "detection subjects the clients of one peer address may hold, whatever identities "
        "they claim; behind a gateway (one peer for all) raise it to --max-series", "10000",
        "--max-series-per-peer", "N",
    ),
    Setting(
        "max_inflight", None, _COUNT,
        "concurrent requests before pushing back with RESOURCE_EXHAUSTED", "16",
        "--max-inflight", "N",
    ),
    Setting(
        "max_calls_per_peer", None, _COUNT,
        "concurrent calls one peer address may hold (waiting for its message or being "
        "served); more are refused with RESOURCE_EXHAUSTED", "16", "--max-calls-per-peer", "N",
    ),
    Setting(
        "receive_timeout_s", None, _SECONDS,
        "how long a call may take to send its request message once it has begun; a call "
        "still silent then is cancelled", "10", "--receive-timeout", "SECONDS",
    ),
    Setting(
        "max_requests_per_s", None,
        number(0, accepted="use a number of requests per second >= 0 (0 = unlimited)"),
        "admission rate over all signals; 0 = unlimited", "0", "--max-requests-per-s", "R",
    ),
    Setting(
        "retry_after_s", None, _SECONDS, "retry delay sent with a push-back, seconds", "1",
        "--retry-after", "SECONDS",
    ),
    Setting(
        "queue_requests", None, _COUNT,
        "requests queued in memory per downstream before dropping", "2048", "--queue-size", "N",
    ),
    Setting(
        "max_recv_bytes", None,
        _in_bytes(number(0.001, 2047, accepted="use a size in MiB from 0.001 to 2047")),
        "largest export request, MiB after decompression (as the Collector); larger ones get "
        "RESOURCE_EXHAUSTED", "4", "--max-recv-mib", "MIB",
    ),
    Setting(
        "memory_limit_mib", None, _memory_limit,
        "resident memory limit, MiB; above 80 % of it exports are refused with "
        "RESOURCE_EXHAUSTED and a retry delay (0 = off)", "1024", "--memory-limit-mib", "MIB",
    ),
    Setting(
        "export_interval_s", None, _SECONDS, "how often detector metrics are sent, seconds",
        "10", "--export-interval", "SECONDS",
    ),
    Setting(
        "telemetry_interval_s", None,
        number(0, accepted="use a number of seconds >= 0 (0 = never)"),
        "how often the processor's own metrics are sent downstream, seconds; 0 = never", "30",
        "--telemetry-interval", "SECONDS",
    ),
    Setting(
        "flush_timeout_s", None, _SECONDS, "bound on the flush at shutdown, seconds", "5",
        "--flush-timeout", "SECONDS",
    ),
)  # fmt: skip

# Bounds of the fields no flag or variable sets, and of those a flag gives in other units.
_FIELD_BOUNDS: dict[str, Parser] = {
    "series_ttl_s": _SECONDS,
    "assemble_grace_s": number(0, accepted="use a number of seconds >= 0"),
    "forward_timeout_s": _SECONDS,
    "forward_retry_s": number(0, accepted="use a number of seconds >= 0"),
    "max_future_s": _SECONDS,
    "queue_bytes": _COUNT,
    "health_max_connections": _COUNT,
    "queue_dir_bytes": _BYTES,
    "max_recv_bytes": _BYTES,
}
_FIELD_CHECKS: dict[str, Parser] = {**{s.name: s.parse for s in DECLARED}, **_FIELD_BOUNDS}
_BY_NAME = {s.name: s for s in DECLARED}


def _check_tls_pair(
    values: Mapping[str, Any], origin: Mapping[str, str], named: Mapping[str, str]
) -> None:
    """A TLS certificate without its key, or a key without its certificate, is refused
    naming the one given (``origin``) and the one missing (``named``)."""
    cert, key = values.get("tls_cert"), values.get("tls_key")
    if (cert is None) == (key is None):
        return
    given, missing = ("tls_cert", "tls_key") if key is None else ("tls_key", "tls_cert")
    refuse(
        origin[given],
        values[given],
        f"a TLS certificate and its key go together: give {named[missing]} too, or neither",
    )


_ANY_HOST = frozenset({"0.0.0.0", "::", ""})
_SERVED = ("listen", "health", "prometheus")  # the addresses the processor binds


def _check_distinct_ports(config: ProcessorConfig) -> None:
    """Two of the processor's servers on one port are refused before any binds (else the first
    serves, and the second fails naming only itself)."""
    seen: list[tuple[str, str, int]] = []
    for name in _SERVED:
        address = getattr(config, name)
        if not address:
            continue
        split = split_hostport(str(address).strip())
        if split is None or split[1] == 0:
            continue  # a bad address is refused by its parser; port 0 picks a free one
        host, port = split
        for other, other_host, other_port in seen:
            if port == other_port and (host == other_host or {host, other_host} & _ANY_HOST):
                refuse(
                    config.source(name),
                    address,
                    f"the port of {config.source(other)} ({getattr(config, other)}); give each "
                    "server its own port",
                )
        seen.append((name, host, port))


@dataclass(frozen=True)
class ProcessorConfig:
    """Processor settings. Times are seconds; sizes are counts unless named ``_bytes``.
    :data:`DECLARED` documents the fields the command sets."""

    listen: str = "127.0.0.1:4317"  # gRPC listen address; port 0 picks a free port
    forward: tuple[Downstream, ...] = ()  # downstream OTLP gRPC endpoints (none by default)
    state_path: str | None = None  # SQLite file for breaker state and history; None: memory
    tls_cert: str | None = None  # PEM certificate chain (with tls_key enables TLS)
    tls_key: str | None = None  # PEM private key
    token: str | None = field(default=None, repr=False)  # bearer token clients must send
    health: str | None = None  # HOST:PORT of the HTTP health endpoint; None: off
    prometheus: str | None = None  # HOST:PORT of a Prometheus /metrics endpoint; None: off
    stall_after_s: float = 300.0  # /healthz fails this long after the last accepted request
    max_series: int = 20_000  # detection subjects held at once; more are counted, not tracked
    series_ttl_s: float = 1800.0  # a subject silent this long (wall time) is forgotten
    assemble_grace_s: float = 1.0  # wait this long (wall) for the rest of a timestamp's points
    max_inflight: int = 16  # concurrent export calls; more are pushed back
    # Calls one peer address holds at once, and how long a call may take to send its message:
    # half-open calls (headers, never a message) cannot lock the other clients out.
    max_calls_per_peer: int = 16
    receive_timeout_s: float = 10.0
    max_requests_per_s: float = 0.0  # admission rate over all signals; 0 = unlimited
    retry_after_s: float = 1.0  # RetryInfo delay sent with a push-back
    # Largest request accepted, after decompression (the Collector's default, 4 MiB).
    max_recv_bytes: int = 4 * 1024 * 1024
    queue_requests: int = 2048  # per downstream (memory queue); more are refused and counted
    queue_bytes: int = 64 * 1024 * 1024  # per downstream (memory queue)
    queue_dir: str | None = None  # disk-backed forward queues here; None: in memory
    queue_dir_bytes: int = 1024 * 1024 * 1024  # per downstream, on disk
    # RSS hard limit; above 80 % of it export requests are refused with a retry delay. 0: off.
    memory_limit_mib: int = 1024
    # Detection subjects one reporter (one resource identity) may hold: a client sending
    # thousands of made-up hw.id values fills its own quota, not everyone's --max-series.
    max_series_per_reporter: int = 2_000
    # Detection subjects one peer address may hold: the reporter identity above is data a
    # client chooses (ten made-up ones fill ten quotas); its address it cannot choose.
    max_series_per_peer: int = 10_000
    health_max_connections: int = 32  # concurrent /healthz connections; more are closed
    forward_timeout_s: float = 10.0  # per send attempt
    forward_retry_s: float = 60.0  # give up on one request after retrying this long
    export_interval_s: float = 10.0  # detector metrics cadence
    telemetry_interval_s: float = 30.0  # the processor's own metrics cadence; 0 = not sent
    flush_timeout_s: float = 5.0  # bound on shutdown flushing
    max_future_s: float = 3600.0  # points further in the future than this are rejected
    min_time_unix_s: float = 946_684_800.0  # points before 2000-01-01 are rejected
    # Field -> the flag or variable it was resolved from, so that a problem found only at start
    # (a port in use, a directory that cannot hold a queue) names what the user set.
    sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The declared bounds, for a config built directly; the command's values passed them.
        named = {n: f"ProcessorConfig {n}" for n in _FIELD_CHECKS}
        pair = {"tls_cert": self.tls_cert, "tls_key": self.tls_key}
        _check_tls_pair(pair, named, {n: n for n in pair})
        for name, parse in _FIELD_CHECKS.items():
            value = getattr(self, name)
            if value is not None:
                parse(value, named[name])

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **explicit: object) -> ProcessorConfig:
        """Explicit values (the command's flags; ``None`` = not given) > ``OTEL_GPU_PROCESSOR_*``
        > defaults; UsageError naming the flag or variable of the first bad value."""
        values, origin = resolve(DECLARED, env=os.environ if env is None else env, args=explicit)
        both = {n: f"{_BY_NAME[n].flag} or {_BY_NAME[n].env}" for n in ("tls_cert", "tls_key")}
        _check_tls_pair(values, origin, both)
        config = cls(**values, sources=origin)
        _check_distinct_ports(config)
        return config

    def source(self, name: str) -> str:
        """The flag or variable the field ``name`` came from (its flag when not resolved)."""
        declared = _BY_NAME.get(name)
        return self.sources.get(name) or (declared and declared.flag) or name


def bind_problem(host: str, port: int) -> str:
    """Why binding ``host:port`` fails, with the fix: gRPC's own reason goes to its C-core log
    (quiet unless GRPC_VERBOSITY is set), so the bind is tried again with a plain socket."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "address already in use: stop the other server or pick another port"
        if exc.errno == errno.EADDRNOTAVAIL:
            return (
                "cannot assign requested address: it is not an address of this host; use "
                "127.0.0.1, 0.0.0.0 or one of this host's addresses"
            )
        return (exc.strerror or str(exc)).lower()
    return "gRPC refused the address"
