"""otel_gpu: OpenTelemetry instrumentation agent for GPU training and inference jobs.

Public API: ``init()`` (start the in-process part without ``opentelemetry-instrument``; a
context manager too), and for hand-written training loops ``phase(name)``,
``step(n, **numbers)``, ``request_stop(reason)``, ``current_phase()``, ``current_step()``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("current_phase", "current_step", "phase", "request_stop", "step")
__all__ = ["__version__", "init", *_API]


def __dir__() -> list[str]:
    return sorted(__all__)


def __getattr__(name: str) -> Any:
    # Lazy: every process under opentelemetry-instrument imports this package (the distro lives
    # here), and launchers must not pay for the tracing API they never use.
    if name in _API:
        from otel_gpu import tracing

        return getattr(tracing, name)
    if name == "init":
        from otel_gpu.distro import init

        return init
    raise AttributeError(f"module 'otel_gpu' has no attribute {name!r}")
