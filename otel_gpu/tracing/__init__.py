"""Training-phase tracing: Trainer / Lightning instrumentation, the phase API and graceful stop.

Public API (re-exported by :mod:`otel_gpu`):

- :func:`phase` — ``with otel_gpu.phase("evaluate"): ...`` times a phase as a span;
- :func:`step` — ``otel_gpu.step(n, loss=...)`` ends step ``n`` of a hand-written loop;
- :func:`request_stop` — ask the in-process trainer to checkpoint and stop (any thread);
- :func:`current_phase`, :func:`current_step` — what the in-process trainer is doing (cheap
  reads of Python variables, for the agent's detectors).
"""

from otel_gpu.tracing.api import phase, step
from otel_gpu.tracing.control import request_stop
from otel_gpu.tracing.progress import current_phase, current_step

__all__ = ["current_phase", "current_step", "phase", "request_stop", "step"]
