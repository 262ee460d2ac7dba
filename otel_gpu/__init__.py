"""otel_gpu: OpenTelemetry instrumentation agent for GPU training and inference jobs."""

__version__ = "0.1.0"
