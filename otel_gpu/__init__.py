"""otel_gpu: OpenTelemetry instrumentation agent for GPU training and inference jobs.

Public API for hand-written training loops (``opentelemetry-instrument`` needs none of it):
``phase(name)``, ``step(n, **numbers)``, ``request_stop(reason)``, ``current_phase()``,
``current_step()``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("MemTracker", "current_phase", "current_step", "phase", "request_stop", "step")
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    # Lazy: every process under opentelemetry-instrument imports this package (the distro lives
    # here), and launchers must not pay for the tracing API they never use.
    if name in _API:
        from otel_gpu import tracing

        return getattr(tracing, name)
    raise AttributeError(f"module 'otel_gpu' has no attribute {name!r}")
