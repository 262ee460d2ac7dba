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
EXPORTERS = ("otlp", "console", "none")

# Environment variable for each setting (documented in README "Settings").
ENV = {
    "interval_s": "OTEL_GPU_INTERVAL",
    "simulate": "OTEL_GPU_SIMULATE",
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


@dataclass(frozen=True)
class Settings:
    """Everything the agent needs to know; see README "Settings" for each variable."""

    interval_s: float = 5.0  # sampler period; 0.1 s at the least
    simulate: str | None = None  # a simulated-GPU scenario instead of NVML
    exporter: str = "otlp"  # otlp | console | none
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
        for f in fields(cls):
            given = explicit.get(f.name)
            if given is not None:
                values[f.name] = _parse(f.name, given, "argument")
                continue
            raw = env.get(ENV[f.name], "").strip()
            if raw:
                values[f.name] = _parse(f.name, raw, ENV[f.name])
        settings = replace(cls(), **values)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        if not self.interval_s >= 0.1:
            raise UsageError(f"interval {self.interval_s} s is too short: use 0.1 s or more")
        if not self.interval_s <= _MAX_SECONDS:
            raise UsageError(f"interval {self.interval_s} s is too long: use at most 3600 s")
        if self.simulate is not None and self.simulate not in SIM_SCENARIOS:
            raise UsageError(
                f"unknown simulation scenario {self.simulate!r}: use one of {', '.join(SIM_SCENARIOS)}"
            )
        if self.exporter not in EXPORTERS:
            raise UsageError(
                f"unknown exporter {self.exporter!r}: use one of {', '.join(EXPORTERS)}"
            )
        if self.endpoint is not None:
            check_endpoint(self.endpoint)
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
                raise UsageError(f"{ENV[name]} must be a positive number of at most 3600 s")


_MAX_SECONDS = 3600.0  # bound on every period and timeout (also rejects inf and NaN)
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
        check_hostport(text, "--health" if source == "argument" else f"{source}=")
        return text
    if name == "server_metrics":
        return check_url(text, "--server-metrics" if source == "argument" else f"{source}=")
    if name in ("simulate", "exporter", "sampler", "process_command"):
        return text.lower()
    return text


def check_endpoint(endpoint: str) -> str:
    """Accept ``http(s)://host:port`` or ``host:port``; raise UsageError otherwise."""
    text = endpoint.strip()
    candidate = text if "://" in text else f"http://{text}"
    parts = urlsplit(candidate)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port in (-1, None):
        raise UsageError(
            f"bad OTLP endpoint {text!r}: use http://HOST:PORT or https://HOST:PORT, port "
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
