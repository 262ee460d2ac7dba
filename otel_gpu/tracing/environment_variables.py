"""``OTEL_GPU_*`` settings of the tracing side, registered under the
``opentelemetry_environment_variables`` entry point group.

``opentelemetry-instrument`` turns every ``OTEL_*`` constant of this module into a flag by
dropping the ``OTEL_`` prefix and lower-casing the rest, so ``OTEL_GPU_STOP`` is also
``opentelemetry-instrument --gpu_stop true ...``. Each is documented in docs/settings.md.
"""

OTEL_GPU_ROLE = "OTEL_GPU_ROLE"
"""What this process does: ``auto`` (default), ``launcher`` (trace context only), ``trainer``
(spans and in-process metrics), ``node`` (trainer plus the node's GPU sampler) or ``off``."""

OTEL_GPU_STEP_SPANS_EVERY = "OTEL_GPU_STEP_SPANS_EVERY"
"""Emit a ``step`` span for every Nth optimizer step (default 1 = all; 0 = none)."""

OTEL_GPU_STOP = "OTEL_GPU_STOP"
"""``true`` lets :func:`otel_gpu.tracing.control.request_stop` checkpoint and stop the trainer
(default ``false``)."""

OTEL_GPU_STOP_SYNC_STEPS = "OTEL_GPU_STOP_SYNC_STEPS"
"""Under DDP, ranks agree on a stop request every this many steps (default 10): one all-reduce
of one integer each time."""

OTEL_GPU_COLLECTIVE_TIMING = "OTEL_GPU_COLLECTIVE_TIMING"
"""``true`` (default) times the blocking ``torch.distributed`` collectives on the CPU, for
``training.step.collective_wait`` and ``training.step.work`` (the straggler judge's input);
``false`` leaves ``torch.distributed`` untouched."""

OTEL_GPU_TRAIN_TRACEPARENT = "OTEL_GPU_TRAIN_TRACEPARENT"
"""W3C ``traceparent`` of the run's ``train`` root span. Set by the first instrumented process
(the launcher) for its children; set it yourself to the same value on every node to get one
trace for a multi-node job."""

OTEL_GPU_PROCESS_COMMAND = "OTEL_GPU_PROCESS_COMMAND"
"""What ``process.command_line`` (and the process resource detector's command line and
arguments) hold: ``redacted`` (default: credentials masked), ``executable`` (the program only)
or ``off`` (none; ``process.command``, argv[0], stays)."""
