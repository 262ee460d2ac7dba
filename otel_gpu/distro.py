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
from otel_gpu.tracing.settings import TracingSettings

log = logging.getLogger("otel_gpu.distro")

# Defaults the distro fills in when unset (README "Settings").
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
            context.set_role(context.OFF)
            print(f"otel-gpu: error: {exc}; telemetry is off in this process", file=sys.stderr)
        except Exception as exc:
            context.set_role(context.OFF)
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
        return None
    from otel_gpu.agent.settings import Settings
    from otel_gpu.tracing import pipeline

    agent_settings = Settings.load()  # validates the agent's OTEL_GPU_* too: one error, up front
    _setup = pipeline.build(
        role,
        auto_instrumentation_version,
        shutdown_timeout_s=agent_settings.shutdown_timeout_s,
        process_command=agent_settings.process_command,
    )
    if role == context.NODE:
        _setup.agent = _start_node_agent(_setup.meter_provider, agent_settings)
    return _setup


def _start_node_agent(meter_provider: Any, agent_settings: Any) -> Any:
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
    return start_in_process(meter_provider, agent_settings, roots, trainer)
