"""The OpenTelemetry distro and configurator that ``opentelemetry-instrument`` loads.

``pip install otel-gpu`` registers both (entry points ``opentelemetry_distro`` /
``opentelemetry_configurator``, name ``otel_gpu``), so ``opentelemetry-instrument swift sft ...``
or ``opentelemetry-instrument torchrun ... train.py`` exports traces, metrics and logs over OTLP
gRPC with no further setup.

The distro only fills in defaults (environment variables the user did not set). The
configurator then decides what this process is (:func:`~otel_gpu.tracing.context.decide_role`):

- ``launcher`` (``swift``, ``torchrun``, ...): hands the run's trace context to its children
  through ``OTEL_GPU_TRAIN_TRACEPARENT`` and sets up nothing else — no SDK, no exporter, no
  thread;
- ``trainer`` (a rank with ``LOCAL_RANK`` > 0): spans, ``training.*`` and torch metrics;
- ``node`` (local rank 0, or the single process): the same, plus the node's GPU and process
  sampler (:func:`otel_gpu.agent.agent.start_in_process`, which also takes a per-node lock);
- ``off`` (multiprocessing spawn workers, torch.compile workers): nothing.

Every role but ``off`` also fixes the job's ``service.instance.id`` in ``OTEL_RESOURCE_ATTRIBUTES``
(:mod:`otel_gpu.core.job_identity`) before anything starts, so all the job's processes share it.

The SDK pipeline itself is in :mod:`otel_gpu.tracing.pipeline`, imported by ``trainer`` and
``node`` processes only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]

from otel_gpu.core.errors import UsageError
from otel_gpu.core.job_identity import ensure_job_id
from otel_gpu.tracing import context
from otel_gpu.tracing.settings import TracingSettings, off_line

log = logging.getLogger("otel_gpu.distro")

# Defaults the distro fills in when unset (docs/settings.md).
DEFAULTS = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_LOGS_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "3",  # seconds per export, retries included (SDK: 10)
    "OTEL_METRIC_EXPORT_INTERVAL": "10000",  # ms (SDK: 60000)
    # No "process" detector: it puts the full command line (tokens in arguments) on every
    # resource. "otel" (OTEL_RESOURCE_ATTRIBUTES) is always added last by the SDK.
    "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "host,otel_gpu_git,otel_gpu_host,otel_gpu_job",
}


class OtelGpuDistro(BaseDistro):  # type: ignore[misc]
    """Entry point ``opentelemetry_distro: otel_gpu``: sensible defaults for GPU jobs."""

    def _configure(self, **kwargs: Any) -> None:
        for name, value in DEFAULTS.items():
            os.environ.setdefault(name, value)


class OtelGpuConfigurator:
    """Entry point ``opentelemetry_configurator: otel_gpu``; never raises into the job.

    Not a subclass of the SDK's ``_BaseConfigurator``: importing that module loads the whole
    SDK (~50 ms), which launcher processes do not need. ``opentelemetry-instrument`` only
    calls ``configure(**kwargs)``.
    """

    def configure(self, **kwargs: Any) -> None:
        try:
            configure(auto_instrumentation_version=kwargs.get("auto_instrumentation_version"))
        except UsageError as exc:
            context.turn_off(off_line(exc))  # and phase(), step(), the callbacks: no-ops
        except Exception as exc:
            context.turn_off(None)
            log.warning("otel-gpu: telemetry is off in this process: %s", exc)


_setup: Any = None


def current_setup() -> Any:
    """The :class:`~otel_gpu.tracing.pipeline.Setup` built here, or None (launcher, off)."""
    return _setup


def configure(
    auto_instrumentation_version: str | None = None,
    argv: Sequence[str] | None = None,
) -> Any:
    """Decide this process's role and build what it needs (see module docstring)."""
    global _setup
    settings = TracingSettings.load()
    role = context.decide_role(
        argv if argv is not None else sys.orig_argv, os.environ, settings.role
    )
    context.set_role(role)
    if role == context.OFF:
        return None
    context.ensure_run_context(os.environ)
    # The job's id, chosen here unless a wrapper or the user gave one, so the processes this
    # one starts report it too (a launcher's ranks, a trainer's workers).
    ensure_job_id(os.environ)
    if role == context.LAUNCHER:
        _flight_recorder_for_ranks()
        return None
    from otel_gpu.agent.settings import Settings

    # Every OTEL_GPU_* this process will read, validated before anything is built or
    # imported (the SDK's log module builds a Resource when imported): a bad value is the one
    # line the configurator prints, and telemetry is off.
    agent_settings = Settings.load()
    detection = None
    if role == context.NODE and agent_settings.detect:
        from otel_gpu.agent.watchdog import DetectionSettings

        detection = DetectionSettings.load()
    from otel_gpu.tracing import pipeline

    _setup = pipeline.build(
        role,
        auto_instrumentation_version,
        shutdown_timeout_s=agent_settings.shutdown_timeout_s,
        process_command=agent_settings.process_command,
        collective_timing=settings.collective_timing,
    )
    if role == context.NODE:
        from otel_gpu.commands.known_env import warn_unknown

        warn_unknown(os.environ)  # once per node, not per rank
        _setup.agent = _start_node_agent(_setup.meter_provider, agent_settings, detection)
    return _setup


def _flight_recorder_for_ranks() -> None:
    """A launcher's ranks get PyTorch's flight recorder (``OTEL_GPU_FLIGHT_RECORDER``), as
    ``otel-gpu run`` gives it to its job; never fails the launcher."""
    try:
        from otel_gpu.agent.settings import Settings
        from otel_gpu.core.runtime_dir import runtime_dir
        from otel_gpu.diagnose.collectives import flight_recorder_env

        if Settings.load().flight_recorder:
            os.environ.update(flight_recorder_env(os.environ, runtime_dir()))
    except Exception as exc:  # a bad setting or no private directory: the job runs without
        log.warning("otel-gpu: flight recorder not set up for the ranks: %s", exc)


def _start_node_agent(meter_provider: Any, agent_settings: Any, detection: Any = None) -> Any:
    """The node's sampler and detection inside this trainer process (when it wins the node
    lock), reading the trainer's phase and step and asking its graceful stop first: the one
    place where tracing and the agent are composed."""
    from otel_gpu.agent.agent import start_in_process
    from otel_gpu.agent.watchdog import InProcessTrainer
    from otel_gpu.tracing import progress
    from otel_gpu.tracing.control import request_stop

    # Under torchrun the parent is torchrun's agent, whose children are all local ranks:
    # watch that tree, so sibling ranks' host memory and CPU are covered too.
    # (TORCHELASTIC_RUN_ID is set by torchrun's agent; a stray LOCAL_RANK in a shell is not.)
    roots = [os.getppid()] if os.environ.get("TORCHELASTIC_RUN_ID") else None
    trainer = InProcessTrainer(
        progress.current_phase, progress.current_step, request_stop, progress.numbers_since
    )
    return start_in_process(meter_provider, agent_settings, roots, trainer, detection)


class Started:
    """What :func:`init` started in this process; a context manager whose exit (or
    :meth:`shutdown`, or the interpreter's exit) flushes and stops it within
    ``OTEL_GPU_SHUTDOWN_TIMEOUT``. ``active``: telemetry runs in this process (False: a bad
    setting, said in one line, or a role with nothing to run)."""

    def __init__(self, setup: Any, owned: bool) -> None:
        self.setup = setup
        self.owned = owned  # False: opentelemetry-instrument (or an earlier init) started it

    @property
    def active(self) -> bool:
        return self.setup is not None

    def shutdown(self) -> None:
        """Flush and stop what :func:`init` started (bounded); never raises."""
        if self.owned and self.setup is not None:
            from otel_gpu.tracing import pipeline

            try:
                pipeline.shutdown(self.setup)
            except Exception as exc:
                log.warning("otel-gpu: shutdown failed: %s", exc)

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()


def init(service_name: str | None = None) -> Started:
    """Start the in-process part in this process, as ``opentelemetry-instrument`` would:
    exporters (the same ``OTEL_*`` / ``OTEL_GPU_*`` settings and defaults), the HF Trainer and
    Lightning instrumentation, the control socket, and the node's sampler and detection when
    this process wins the node lock. Once per process: under ``opentelemetry-instrument`` (or
    after an earlier call) it returns what runs already. ``service_name``: the job's
    ``service.name`` unless ``OTEL_SERVICE_NAME`` says otherwise. Never raises into the caller;
    a bad setting is one line on stderr and telemetry stays off.

        with otel_gpu.init():
            train()
    """
    existing = current_setup()
    if existing is not None:
        return Started(existing, owned=False)
    try:
        if service_name:
            os.environ.setdefault("OTEL_SERVICE_NAME", service_name)
        OtelGpuDistro()._configure()
        setup = configure()
    except UsageError as exc:
        context.turn_off(off_line(exc))  # and phase(), step(), the callbacks: no-ops
        return Started(None, owned=False)
    except Exception as exc:
        context.turn_off(None)
        log.warning("otel-gpu: telemetry is off in this process: %s", exc)
        return Started(None, owned=False)
    if setup is not None:
        _instrument_frameworks(setup)
    return Started(setup, owned=True)


def _instrument_frameworks(setup: Any) -> None:
    """The Trainer instrumentors ``opentelemetry-instrument`` would load from our entry
    points (each waits for its framework's import; a framework not installed is skipped)."""
    from otel_gpu.tracing.hf_instrumentor import TransformersInstrumentor
    from otel_gpu.tracing.lightning_callback import LightningInstrumentor

    for instrumentor in (TransformersInstrumentor(), LightningInstrumentor()):
        try:
            # A conflict (framework missing or too old) raises here rather than logging an
            # error: as under opentelemetry-instrument, that framework is just not instrumented.
            instrumentor.instrument(
                tracer_provider=setup.tracer_provider, raise_exception_on_conflict=True
            )
        except Exception as exc:
            log.debug("otel-gpu: %s not applied: %s", type(instrumentor).__name__, exc)
