"""Agent settings: explicit argument > ``OTEL_GPU_*`` / ``OTEL_*`` environment > default.

Validated once at start; a bad value raises :class:`UsageError` naming the setting and what it
accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from urllib.parse import urlsplit

from otel_gpu.errors import UsageError
from otel_gpu.redact import COMMAND_MODES, COMMAND_REDACTED

SIM_SCENARIOS = ("steady", "leak", "stall")
# Metric exporters; any of the first three combine (``otlp,prometheus``), ``none`` stands alone.
EXPORTERS = ("otlp", "console", "prometheus", "none")

# Environment variable for each setting (documented in README "Settings").
ENV = {
    "interval_s": "OTEL_GPU_INTERVAL",
    "simulate": "OTEL_GPU_SIMULATE",
    "simulate_speed": "OTEL_GPU_SIMULATE_SPEED",
    "exporter": "OTEL_METRICS_EXPORTER",
    "endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "export_interval_s": "OTEL_METRIC_EXPORT_INTERVAL",  # milliseconds, as the OTel spec says
    "export_timeout_s": "OTEL_EXPORTER_OTLP_TIMEOUT",  # seconds, as the Python SDK reads it
    "nvml_timeout_s": "OTEL_GPU_NVML_TIMEOUT",
    "nvml_library": "OTEL_GPU_NVML_LIBRARY",
    "max_processes": "OTEL_GPU_MAX_PROCESSES",
    "proc_root": "OTEL_GPU_PROC_ROOT",
    "detect": "OTEL_GPU_DETECT",
    "shutdown_timeout_s": "OTEL_GPU_SHUTDOWN_TIMEOUT",
    "lock_dir": "OTEL_GPU_LOCK_DIR",
    "sampler": "OTEL_GPU_SAMPLER",
    "health": "OTEL_GPU_HEALTH",
    "health_export_grace_s": "OTEL_GPU_HEALTH_EXPORT_GRACE",
    "process_command": "OTEL_GPU_PROCESS_COMMAND",
    "server_metrics": "OTEL_GPU_SERVER_METRICS",
}
SAMPLER_MODES = ("process", "thread")
# The flag of each setting that commands take on the command line (error messages name it).
FLAGS = {
    "interval_s": "--interval",
    "simulate": "--simulate",
    "exporter": "--exporter",
    "endpoint": "--endpoint",
    "export_interval_s": "--export-interval",
    "detect": "--no-detect",
    "health": "--health",
    "server_metrics": "--server-metrics",
}


@dataclass(frozen=True)
class Settings:
    """Everything the agent needs to know; see README "Settings" for each variable."""

    interval_s: float = 5.0  # sampler period; 0.1 s at the least
    simulate: str | None = None  # a simulated-GPU scenario instead of NVML
    # Simulated seconds per wall second: a demo stack shows hours of a leak within minutes.
    simulate_speed: float = 1.0
    exporter: str = "otlp"  # comma list of otlp, console, prometheus; or none
    endpoint: str | None = None  # OTLP gRPC endpoint; None: the SDK's default (localhost:4317)
    export_interval_s: float = 10.0  # metric export period
    export_timeout_s: float = 3.0  # per export, retries included
    nvml_timeout_s: float = 2.0  # deadline for one NVML call
    nvml_library: str | None = None  # absolute path of libnvidia-ml.so.1 to load
    max_processes: int = 256  # processes tracked per sweep; the rest are counted as dropped
    proc_root: str = "/proc"
    detect: bool = True  # run the detection engine in the agent
    shutdown_timeout_s: float = 5.0  # bound on flush + shutdown
    lock_dir: str | None = None  # where the node-ownership lock lives (default: temp dir)
    # process: NVML and /proc are read in a supervised helper process (crash-isolated);
    # thread: on a thread of the agent's own process (no isolation; for debugging).
    sampler: str = "process"
    health: str | None = None  # HOST:PORT of the /healthz endpoint; None: no endpoint
    health_export_grace_s: float = 60.0  # exports failing this long make /healthz 503
    # What process.command (and the process detector's command attributes) hold: redacted,
    # executable or off (otel_gpu.redact).
    process_command: str = COMMAND_REDACTED
    # The inference server's Prometheus URL the sidecar scrapes; None: no scrape.
    server_metrics: str | None = None

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **explicit: object) -> Settings:
        """Build settings from explicit values (``None`` = not given), then env, then defaults."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        origin: dict[str, str] = {}  # where each given value came from, for error messages
        for f in fields(cls):
            given = explicit.get(f.name)
            if given is not None:
                origin[f.name] = FLAGS.get(f.name, "argument")
                values[f.name] = _parse(f.name, given, origin[f.name])
                continue
            raw = env.get(ENV[f.name], "").strip()
            if raw:
                origin[f.name] = ENV[f.name]
                values[f.name] = _parse(f.name, raw, ENV[f.name])
        settings = replace(cls(), **values)  # type: ignore[arg-type]
        settings.validate(origin)
        if "otlp" in settings.exporters:
            check_otlp_environment(env)
        return settings

    @property
    def exporters(self) -> tuple[str, ...]:
        """The metric exporters asked for, e.g. ``("otlp", "prometheus")``; ``()`` for none."""
        return tuple(n for n in _exporter_names(self.exporter, "exporter") if n != "none")

    def validate(self, origin: Mapping[str, str] | None = None) -> None:
        """Raise UsageError for the first bad value; ``origin`` maps a field to the flag or
        variable it came from (default: its variable), so the message names what the user set."""
        origin = origin or {}

        def where(name: str) -> str:
            return origin.get(name, ENV[name])

        if not self.interval_s >= 0.1:
            raise UsageError(f"interval {self.interval_s} s is too short: use 0.1 s or more")
        if not self.interval_s <= _MAX_SECONDS:
            raise UsageError(f"interval {self.interval_s} s is too long: use at most 3600 s")
        if self.simulate is not None and self.simulate not in SIM_SCENARIOS:
            raise UsageError(
                f"unknown simulation scenario {self.simulate!r}: use one of {', '.join(SIM_SCENARIOS)}"
            )
        _exporter_names(self.exporter, "exporter")
        if not 1.0 <= self.simulate_speed <= 10_000.0:
            raise UsageError(
                f"{ENV['simulate_speed']}={self.simulate_speed}: use a speed from 1 to 10000"
            )
        if self.endpoint is not None:
            check_endpoint(self.endpoint, where("endpoint"))
        if self.sampler not in SAMPLER_MODES:
            raise UsageError(
                f"{ENV['sampler']}={self.sampler!r}: use one of {', '.join(SAMPLER_MODES)}"
            )
        if self.process_command not in COMMAND_MODES:
            raise UsageError(
                f"{ENV['process_command']}={self.process_command!r}: use one of "
                f"{', '.join(COMMAND_MODES)}"
            )
        if self.max_processes < 1:
            raise UsageError("max processes must be at least 1 (OTEL_GPU_MAX_PROCESSES)")
        for name in (
            "export_interval_s",
            "export_timeout_s",
            "nvml_timeout_s",
            "shutdown_timeout_s",
            "health_export_grace_s",
        ):
            if not 0 < getattr(self, name) <= _MAX_SECONDS:
                if where(name) == _MS_VARIABLE:
                    raise UsageError(
                        f"{_MS_VARIABLE} must be a positive number of ms, at most 3600000"
                    )
                raise UsageError(f"{where(name)} must be a positive number of at most 3600 s")
        if not os.path.isfile(os.path.join(self.proc_root, "stat")):
            raise UsageError(
                f"{where('proc_root')}={self.proc_root}: no process table there (no "
                f"{os.path.join(self.proc_root, 'stat')}); unset it, or mount the host's /proc "
                "and point it there"
            )
        if self.nvml_library is not None:
            lib = self.nvml_library
            if not os.path.isabs(lib):
                raise UsageError(
                    f"{where('nvml_library')}={lib} is a relative path: give the absolute path "
                    "of libnvidia-ml.so.1 (e.g. /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1)"
                )
            if not os.path.isfile(lib):
                raise UsageError(
                    f"{where('nvml_library')}={lib}: no such file; give the path of an existing "
                    "libnvidia-ml.so.1, or unset it to use the driver's"
                )


_MAX_SECONDS = 3600.0  # bound on every period and timeout (also rejects inf and NaN)
_MS_VARIABLE = "OTEL_METRIC_EXPORT_INTERVAL"  # the one period set in milliseconds
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(name: str, raw: object, source: str) -> object:
    """Convert one raw value to the field's type; errors name where the value came from."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    try:
        if name in (
            "interval_s",
            "simulate_speed",
            "export_timeout_s",
            "nvml_timeout_s",
            "shutdown_timeout_s",
            "health_export_grace_s",
        ):
            return float(text)
        if name == "export_interval_s":
            # OTEL_METRIC_EXPORT_INTERVAL is milliseconds; explicit arguments are seconds.
            return float(text) / 1000.0 if source == ENV[name] else float(text)
        if name == "max_processes":
            return int(text)
    except ValueError:
        raise UsageError(f"{source}={text!r} is not a number") from None
    if name == "detect":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise UsageError(f"{source}={text!r}: use true or false")
    if name == "health":
        check_hostport(text, source if source.startswith("-") else f"{source}=")
        return text
    if name == "server_metrics":
        return check_url(text, source if source.startswith("-") else f"{source}=")
    if name == "exporter":
        return ",".join(_exporter_names(text, source))
    if name in ("simulate", "sampler", "process_command"):
        return text.lower()
    return text


def _exporter_names(text: str, source: str) -> tuple[str, ...]:
    """``otlp,prometheus`` -> ``("otlp", "prometheus")``; duplicates dropped, order kept."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    for n in names:
        if n not in EXPORTERS:
            raise UsageError(
                f"{source}={text!r}: unknown exporter {n!r}; use one or more of "
                "otlp, console, prometheus (comma-separated), or none"
            )
    if not names or ("none" in names and len(names) > 1):
        raise UsageError(
            f"{source}={text!r}: use one or more of otlp, console, prometheus "
            "(comma-separated), or none alone"
        )
    return names


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


def check_hostport(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) with a port in 0..65535; UsageError otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        shown = f"{flag}{text}" if flag.endswith("=") else f"{flag} {text}"
        raise UsageError(f"{shown}: use HOST:PORT with a port from 0 to 65535, e.g. 127.0.0.1:8081")
    return host, int(port)


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


def check_url(url: str, flag: str) -> str:
    """Accept ``http(s)://HOST[:PORT]/PATH`` (an inference server's metrics); UsageError else."""
    text = url.strip()
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        shown = f"{flag}{text}" if flag.endswith("=") else f"{flag} {text}"
        raise UsageError(
            f"{shown}: use the server's Prometheus URL, e.g. http://127.0.0.1:8000/metrics"
        )
    return text
