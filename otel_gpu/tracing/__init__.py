"""Training-phase tracing: Trainer / Lightning instrumentation, the phase API and graceful stop.

Public API (re-exported by :mod:`otel_gpu`):

- :func:`phase` — ``with otel_gpu.phase("evaluate"): ...`` times a phase as a span;
- :func:`step` — ``otel_gpu.step(n, loss=...)`` ends step ``n`` of a hand-written loop;
- :func:`request_stop` — ask the in-process trainer to checkpoint and stop (any thread);
- :class:`MemTracker` — allocator counters (RSS on CPU builds) at up to 100 Hz, peaks per
  phase and step;
- :func:`current_phase`, :func:`current_step` — what the in-process trainer is doing (cheap
  reads of Python variables, for the agent's detectors).
"""

from otel_gpu.tracing.api import phase, step
from otel_gpu.tracing.control import request_stop
from otel_gpu.tracing.memtracker import MemTracker
from otel_gpu.tracing.progress import current_phase, current_step

__all__ = ["MemTracker", "current_phase", "current_step", "phase", "request_stop", "step"]
