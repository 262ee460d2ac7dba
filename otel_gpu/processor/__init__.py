"""``otel-gpu processor``: an OTLP gRPC service that forwards everything it receives and runs
the detection engine fleet-wide on the GPU series in it.

    from otel_gpu.processor import Processor, ProcessorConfig
    p = Processor(ProcessorConfig(listen="127.0.0.1:4317", forward=(Downstream.parse("b:4317"),)))
    p.start(); ...; p.stop()
"""

from otel_gpu.processor.server import Processor
from otel_gpu.processor.settings import Downstream, ProcessorConfig

__all__ = ["Downstream", "Processor", "ProcessorConfig"]
