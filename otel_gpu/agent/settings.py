"""Agent settings: explicit argument > ``OTEL_GPU_*`` / ``OTEL_*`` environment > default.

Declared once in :data:`DECLARED` (resolved by :mod:`otel_gpu.core.settings`); validated once at
start, where a command builds the agent. A bad value raises :class:`UsageError` naming the flag
or variable the user set and what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from otel_gpu.core.addresses import check_url, parse_hostport
from otel_gpu.core.errors import UsageError
from otel_gpu.core.otlp import check_endpoint, check_otlp_environment
from otel_gpu.core.redact import COMMAND_MODES, COMMAND_REDACTED
from otel_gpu.core.settings import Parser, Setting, boolean, choice, number, refuse, resolve, text

SIM_SCENARIOS = ("steady", "leak", "stall")
# Metric exporters; any of the first three combine (``otlp,prometheus``), ``none`` stands alone.
EXPORTERS = ("otlp", "console", "prometheus", "none")
SAMPLER_MODES = ("process", "thread")
_MAX_SECONDS = 3600.0  # bound on every period and timeout (also rejects inf and NaN)


def _seconds(what: str = "a positive number of seconds, at most 3600") -> Parser:
    return number(0.0, _MAX_SECONDS, low_open=True, accepted=f"use {what}")


def _simulate(raw: object, source: str) -> str:
    name = str(raw).strip().lower()
    if name not in SIM_SCENARIOS:
        refuse(
            source,
            raw,
            f"unknown simulation scenario {name!r}: use one of {', '.join(SIM_SCENARIOS)}",
        )
    return name


def _exporter(raw: object, source: str) -> str:
    return ",".join(_exporter_names(str(raw), source))


def _endpoint(raw: object, source: str) -> str:
    return check_endpoint(str(raw), source)


def _shown(source: str) -> str:
    """How a hand-written message names the source: ``--flag VALUE`` or ``VAR=VALUE``."""
    return source if source.startswith("-") else f"{source}="


def _health(raw: object, source: str) -> str:
    address = str(raw).strip()
    parse_hostport(address, source, example="127.0.0.1:8081")
    return address


def _server_metrics(raw: object, source: str) -> str:
    return check_url(str(raw), _shown(source))


def _proc_root(raw: object, source: str) -> str:
    root = str(raw).strip()
    if not os.path.isfile(os.path.join(root, "stat")):
        raise UsageError(
            f"{source}={root}: no process table there (no {os.path.join(root, 'stat')}); "
            "unset it, or mount the host's /proc and point it there"
        )
    return root


def _nvml_library(raw: object, source: str) -> str:
    lib = str(raw).strip()
    if not os.path.isabs(lib):
        raise UsageError(
            f"{source}={lib} is a relative path: give the absolute path of libnvidia-ml.so.1 "
            "(e.g. /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1)"
        )
    if not os.path.isfile(lib):
        raise UsageError(
            f"{source}={lib}: no such file; give the path of an existing libnvidia-ml.so.1, or "
            "unset it to use the driver's"
        )
    return lib


def _kernel_log(raw: object, source: str) -> str | None:
    path = str(raw).strip()
    if path.lower() in ("none", "off", ""):
        return None
    if not os.path.isabs(path):
        raise UsageError(
            f"{source}={path} is a relative path: give the absolute path of the kernel log "
            "(/dev/kmsg), or none to read Xids from NVML only"
        )
    return path


# Every agent setting, declared once (docs/cli.md and docs/settings.md list them; a test
# checks the tables against these). Fields of Settings, in its order.
DECLARED = (
    Setting(
        "interval_s", "OTEL_GPU_INTERVAL",
        number(0.1, _MAX_SECONDS, accepted="use 0.1 s or more (at most 3600 s)"),
        "sampling period in seconds (0.1 or more)", "5", "--interval", "SECONDS",
    ),
    Setting(
        "simulate", "OTEL_GPU_SIMULATE", _simulate,
        "`steady`, `leak` or `stall`: a simulated GPU instead of NVML", "—", "--simulate",
        "SCENARIO",
    ),
    Setting(
        "simulate_speed", "OTEL_GPU_SIMULATE_SPEED",
        number(1.0, 10_000.0, accepted="use a speed from 1 to 10000"),
        "simulated seconds per wall second (1–10000): `240` shows a simulated leak's alert "
        "within about a minute", "1",
    ),
    Setting(
        "exporter", "OTEL_METRICS_EXPORTER", _exporter,
        "`otlp`, `console`, `prometheus` (a `/metrics` scrape endpoint, see \"Deploy\"), several "
        "comma-separated (`otlp,prometheus`), or `none`", "otlp", "--exporter", "NAMES",
    ),
    Setting(
        "endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", _endpoint, "OTLP gRPC endpoint",
        "SDK default", "--endpoint", "URL",
    ),
    Setting(
        "export_interval_s", "OTEL_METRIC_EXPORT_INTERVAL", _seconds(),
        "metric export period", "10 s", "--export-interval", "SECONDS",
        # The OTel specification sets this variable in milliseconds; the flag is seconds.
        env_parse=number(
            0.0, _MAX_SECONDS * 1000, low_open=True, scale=0.001,
            accepted="use a positive number of milliseconds, at most 3600000",
        ),
    ),
    Setting(
        "export_timeout_s", "OTEL_EXPORTER_OTLP_TIMEOUT", _seconds(),
        "seconds per export, retries included", "3",
    ),
    Setting(
        "nvml_timeout_s", "OTEL_GPU_NVML_TIMEOUT", _seconds(),
        "deadline of one NVML call, seconds", "2",
    ),
    Setting(
        "nvml_library", "OTEL_GPU_NVML_LIBRARY", _nvml_library,
        "absolute path of `libnvidia-ml.so.1` to load (a relative or missing path is refused)",
    ),
    Setting(
        "kernel_log", "OTEL_GPU_KERNEL_LOG", _kernel_log,
        "where Xids are also read from the kernel log (`none`: off); without read access "
        "(CAP_SYSLOG or `kernel.dmesg_restrict=0`) it is off with one log line", "/dev/kmsg",
    ),
    Setting(
        "max_processes", "OTEL_GPU_MAX_PROCESSES",
        number(1, accepted="use a whole number, 1 or more", integer=True),
        "processes tracked per sweep; the rest are counted in "
        "`otel_gpu.agent.processes.dropped`", "256",
    ),
    Setting(
        "proc_root", "OTEL_GPU_PROC_ROOT", _proc_root,
        "a host `/proc` mounted elsewhere (containers); refused when it holds no `stat` file",
        "/proc",
    ),
    Setting(
        "detect", "OTEL_GPU_DETECT", boolean,
        "leak / stall detection in the agent", "true", "--no-detect", flag_const=False,
        flag_doc="turn off leak / stall detection in the agent (no alerts, no breaker)",
    ),
    Setting(
        "shutdown_timeout_s", "OTEL_GPU_SHUTDOWN_TIMEOUT", _seconds(),
        "bound on flush and shutdown, seconds", "5",
    ),
    Setting(
        "lock_dir", "OTEL_GPU_LOCK_DIR", text,
        "where the one-sampler-per-node lock lives: a directory only you can write (others' "
        "write access is refused; the lock file is never followed through a symlink)",
        "the runtime directory (`OTEL_GPU_RUNTIME_DIR`)",
    ),
    Setting(
        "flight_recorder", "OTEL_GPU_FLIGHT_RECORDER", boolean,
        "`otel-gpu run` (and a launcher under `opentelemetry-instrument`) turns on PyTorch's "
        "flight recorder for the job: `TORCH_FR_BUFFER_SIZE` 2000, `TORCH_NCCL_DEBUG_INFO_PIPE_FILE`"
        " and `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` in the runtime directory, each only when unset; "
        "`false`: none of them", "true",
    ),
    Setting(
        "stall_diagnosis", "OTEL_GPU_STALL_DIAGNOSIS", boolean,
        "a stall alert carries where the job is stuck: every rank's stacks, grouped, and the "
        "collective a rank has not joined (see \"When a job hangs\"); `false`: it does not",
        "true",
    ),
    Setting(
        "sampler", "OTEL_GPU_SAMPLER", choice(SAMPLER_MODES),
        "`process`: NVML and `/proc` in a supervised helper process; `thread`: in the agent's "
        "process (no crash isolation)", "process",
    ),
    Setting(
        "health", "OTEL_GPU_HEALTH", _health,
        "serve `/healthz` and `/exportz` (see \"Health endpoint\")", "off", "--health",
        "HOST:PORT",
    ),
    Setting(
        "health_export_grace_s", "OTEL_GPU_HEALTH_EXPORT_GRACE", _seconds(),
        "seconds of failing exports before `/exportz` answers 503 (`/healthz` only says so)",
        "60",
    ),
    Setting(
        "process_command", "OTEL_GPU_PROCESS_COMMAND", choice(COMMAND_MODES),
        "what `process.command_line` holds: `redacted` (the command line, credentials masked), "
        "`executable` (the program, and a Python script or `-m` module) or `off` (no command "
        "line; `process.command`, argv[0], stays); see \"What is redacted\"", "redacted",
    ),
    Setting(
        "cpu_budget", "OTEL_GPU_CPU_BUDGET",
        number(0.0, 100.0, accepted="use a percent of one core from 0 (off) to 100"),
        "the agent's CPU budget, percent of one core: above it (or on a saturated host) "
        "per-process `/proc` details, then per-process GPU utilization, are read less often "
        "(`otel_gpu.agent.sampling.interval`); never while a leak or stall is suspected; `0`: off",
        "2",
    ),
    Setting(
        "server_metrics", "OTEL_GPU_SERVER_METRICS", _server_metrics,
        "the server's Prometheus endpoint, scraped each interval (2 s timeout, 8 MiB cap)",
        "off", "--server-metrics", "URL",
    ),
    Setting(
        "instrument", "OTEL_GPU_INSTRUMENT", boolean,
        "`run` loads the in-process part into a Python job started without "
        "`opentelemetry-instrument` (a `sitecustomize` first on its `PYTHONPATH`; any other "
        "`sitecustomize` still loads)", "true", "--no-instrument", flag_const=False,
        flag_doc="do not load the in-process part into a Python job started without "
        "opentelemetry-instrument",
    ),
)  # fmt: skip
# The environment variable of each setting (the doctor and error messages name them).
ENV = {s.name: s.env for s in DECLARED}
# The options every watching command (run, watch, sidecar) takes; the sidecar adds its own.
AGENT_OPTIONS = tuple(
    s for s in DECLARED if s.flag and s.name not in ("server_metrics", "instrument")
)
SIDECAR_OPTIONS = tuple(s for s in DECLARED if s.name == "server_metrics")
RUN_OPTIONS = tuple(s for s in DECLARED if s.name == "instrument")


@dataclass(frozen=True)
class Settings:
    """Everything the agent needs to know; :data:`DECLARED` documents each field."""

    interval_s: float = 5.0  # sampler period
    simulate: str | None = None  # a simulated-GPU scenario instead of NVML
    # Simulated seconds per wall second: a demo stack shows hours of a leak within minutes.
    simulate_speed: float = 1.0
    exporter: str = "otlp"  # comma list of otlp, console, prometheus; or none
    endpoint: str | None = None  # OTLP gRPC endpoint; None: the SDK's default (localhost:4317)
    export_interval_s: float = 10.0  # metric export period
    export_timeout_s: float = 3.0  # per export, retries included
    nvml_timeout_s: float = 2.0  # deadline for one NVML call
    nvml_library: str | None = None  # absolute path of libnvidia-ml.so.1 to load
    kernel_log: str | None = "/dev/kmsg"  # Xids from the kernel log too (None: off)
    max_processes: int = 256  # processes tracked per sweep; the rest are counted as dropped
    proc_root: str = "/proc"
    detect: bool = True  # run the detection engine in the agent
    shutdown_timeout_s: float = 5.0  # bound on flush + shutdown
    lock_dir: str | None = None  # where the node-ownership lock lives (default: temp dir)
    flight_recorder: bool = True  # the job gets PyTorch's flight-recorder variables
    stall_diagnosis: bool = True  # stall alerts wait (bounded) for where the job is stuck
    # process: NVML and /proc are read in a supervised helper process (crash-isolated);
    # thread: on a thread of the agent's own process (no isolation; for debugging).
    sampler: str = "process"
    health: str | None = None  # HOST:PORT of /healthz and /exportz; None: no endpoint
    health_export_grace_s: float = 60.0  # exports failing this long make /exportz 503
    # What process.command_line (and the process detector's command line and arguments) hold:
    # redacted, executable or off (otel_gpu.core.redact).
    process_command: str = COMMAND_REDACTED
    # The agent's CPU budget in percent of one core (adaptive sampling); 0: off.
    cpu_budget: float = 2.0
    # The inference server's Prometheus URL the sidecar scrapes; None: no scrape.
    server_metrics: str | None = None
    # run: load the in-process part into a Python job without opentelemetry-instrument.
    instrument: bool = True

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **explicit: object) -> Settings:
        """Explicit values (``None`` = not given; errors name the setting's flag), then the
        environment, then the defaults; UsageError on the first bad value."""
        env = os.environ if env is None else env
        unknown = set(explicit) - set(ENV)
        if unknown:
            raise TypeError(f"unknown agent settings: {', '.join(sorted(unknown))}")
        values, _origin = resolve(DECLARED, env=env, args=explicit)
        settings = cls(**values)
        if "otlp" in settings.exporters:
            check_otlp_environment(env)
        return settings

    @property
    def exporters(self) -> tuple[str, ...]:
        """The metric exporters asked for, e.g. ``("otlp", "prometheus")``; ``()`` for none."""
        return tuple(n for n in _exporter_names(self.exporter, "exporter") if n != "none")


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
