"""Settings of the OTLP processor service, validated once at start.

Every bad value raises :class:`UsageError` naming the setting and what it accepts, so the CLI can
print one line and exit 2.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import re
import socket
from dataclasses import dataclass, field

from otel_gpu.errors import UsageError

_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?$")


def parse_hostport(value: str, setting: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) -> (host, port); UsageError otherwise."""
    raw = value.strip()
    hint = f"{setting} {value!r} is not HOST:PORT (e.g. 127.0.0.1:4317)"
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0 or raw[end + 1 : end + 2] != ":":
            raise UsageError(hint)
        host, port_s = raw[1:end], raw[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(hint) from None
    else:
        host, sep, port_s = raw.rpartition(":")
        if not sep or not host or ":" in host or not _HOST_RE.match(host):
            raise UsageError(hint)
    if not port_s.isdigit():
        raise UsageError(hint)
    port = int(port_s)
    if port > 65535 or (port == 0 and not allow_port_zero):
        raise UsageError(f"{setting} {value!r}: port must be 1..65535")
    return host, port


def format_hostport(host: str, port: int) -> str:
    """Inverse of :func:`parse_hostport` (brackets IPv6 literals)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Downstream:
    """One forwarding target: a gRPC target string and whether to use TLS."""

    target: str  # host:port as grpc expects it
    tls: bool = False

    @classmethod
    def parse(cls, value: str) -> Downstream:
        """``HOST:PORT``, ``http://HOST:PORT`` (plaintext) or ``https://HOST:PORT`` (TLS)."""
        raw = value.strip()
        tls = False
        for scheme, is_tls in (("http://", False), ("https://", True), ("grpc://", False)):
            if raw.lower().startswith(scheme):
                raw, tls = raw[len(scheme) :].rstrip("/"), is_tls
                break
        host, port = parse_hostport(raw, "--forward", allow_port_zero=False)
        return cls(format_hostport(host, port), tls)


@dataclass(frozen=True)
class ProcessorConfig:
    """Processor settings. Times are seconds; sizes are counts unless named ``_bytes``."""

    listen: str = "127.0.0.1:4317"  # gRPC listen address; port 0 picks a free port
    forward: tuple[Downstream, ...] = ()  # downstream OTLP gRPC endpoints (none by default)
    state_path: str | None = None  # SQLite file for breaker state and history; None: memory
    tls_cert: str | None = None  # PEM certificate chain (with tls_key enables TLS)
    tls_key: str | None = None  # PEM private key
    token: str | None = field(default=None, repr=False)  # bearer token clients must send
    health: str | None = None  # HOST:PORT of the HTTP health endpoint; None: off
    prometheus: str | None = None  # HOST:PORT of the Prometheus /metrics endpoint; None: off
    stall_after_s: float = 300.0  # /healthz fails this long after the last accepted request
    max_series: int = 20_000  # detection subjects held at once; more are counted, not tracked
    series_ttl_s: float = 1800.0  # a subject silent this long (wall time) is forgotten
    assemble_grace_s: float = 1.0  # wait this long (wall) for the rest of a timestamp's points
    max_inflight: int = 16  # concurrent export calls; more are pushed back
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
    health_max_connections: int = 32  # concurrent /healthz connections; more are closed
    forward_timeout_s: float = 10.0  # per send attempt
    forward_retry_s: float = 60.0  # give up on one request after retrying this long
    export_interval_s: float = 10.0  # detector metrics cadence
    telemetry_interval_s: float = 30.0  # the processor's own metrics cadence; 0 = not sent
    flush_timeout_s: float = 5.0  # bound on shutdown flushing
    max_future_s: float = 3600.0  # points further in the future than this are rejected
    min_time_unix_s: float = 946_684_800.0  # points before 2000-01-01 are rejected

    def __post_init__(self) -> None:
        parse_hostport(self.listen, "--listen")
        if self.health is not None:
            parse_hostport(self.health, "--health")
        if self.prometheus is not None:
            parse_hostport(self.prometheus, "--prometheus")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together: give both or neither")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise UsageError("the processor token must be non-empty and have no whitespace")
        positive = (
            ("stall_after_s", "--stall-after"),
            ("series_ttl_s", "series_ttl_s"),
            ("retry_after_s", "--retry-after"),
            ("forward_timeout_s", "forward_timeout_s"),
            ("export_interval_s", "--export-interval"),
            ("flush_timeout_s", "--flush-timeout"),
            ("max_future_s", "max_future_s"),
        )
        for attr, name in positive:
            v = getattr(self, attr)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UsageError(f"{name} must be a number of seconds > 0, got {v!r}")
        non_negative = (
            ("assemble_grace_s", "assemble_grace_s"),
            ("max_requests_per_s", "--max-requests-per-s"),
            ("forward_retry_s", "forward_retry_s"),
            ("telemetry_interval_s", "--telemetry-interval"),
        )
        for attr, name in non_negative:
            v = getattr(self, attr)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UsageError(f"{name} must be a number >= 0, got {v!r}")
        counts = (
            ("max_series", "--max-series"),
            ("max_inflight", "--max-inflight"),
            ("queue_requests", "--queue-size"),
            ("queue_bytes", "queue_bytes"),
            ("max_series_per_reporter", "--max-series-per-reporter"),
            ("health_max_connections", "health_max_connections"),
        )
        for attr, name in counts:
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")
        for attr, name, least in (
            ("max_recv_bytes", "--max-recv-mib", 1024),
            ("queue_dir_bytes", "--queue-dir-mib", 1024),
        ):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise UsageError(
                    f"{name} gives {v!r} bytes, below the minimum of {least} bytes; "
                    "give a size in MiB such as the default"
                )
        m = self.memory_limit_mib
        if isinstance(m, bool) or not isinstance(m, int) or (m != 0 and m < 64):
            raise UsageError(f"--memory-limit-mib must be 0 (off) or an integer >= 64, got {m!r}")


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
