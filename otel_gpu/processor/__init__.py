"""``otel-gpu processor``: an OTLP gRPC service that forwards everything it receives and runs
the detection engine fleet-wide on the GPU series in it.

    from otel_gpu.processor import Processor, ProcessorConfig
    p = Processor(ProcessorConfig(listen="127.0.0.1:4317", forward=(Downstream.parse("b:4317"),)))
    p.start(); ...; p.stop()

The names are imported on first use: the agent reads :mod:`otel_gpu.processor.settings` (every
known variable, for the typo warning) without loading the server, its gRPC service, SQLite and
the Prometheus client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_gpu.processor.server import Processor
    from otel_gpu.processor.settings import Downstream, ProcessorConfig

__all__ = ["Downstream", "Processor", "ProcessorConfig"]

_WHERE = {
    "Processor": "otel_gpu.processor.server",
    "Downstream": "otel_gpu.processor.settings",
    "ProcessorConfig": "otel_gpu.processor.settings",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'otel_gpu.processor' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
