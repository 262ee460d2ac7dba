"""The processor's own telemetry (``otel_gpu.processor.*``), sent downstream with the data
(``otel_gpu/processor/telemetry.py``). Counters are cumulative since the processor started."""

from otel_gpu.core.signals.model import COUNTER, GAUGE, Signal

OTLP_SIGNAL = "signal"  # attribute: metrics, traces, logs
DOWNSTREAM = "downstream"  # attribute: the downstream's target (host:port)

PROCESSOR_REQUESTS_ACCEPTED = Signal(
    "otel_gpu.processor.requests.accepted",
    COUNTER,
    "{request}",
    "export requests accepted, per signal",
)
PROCESSOR_REQUESTS_REFUSED = Signal(
    "otel_gpu.processor.requests.refused",
    COUNTER,
    "{request}",
    "export requests refused, per signal",
)
PROCESSOR_POINTS_ACCEPTED = Signal(
    "otel_gpu.processor.points.accepted", COUNTER, "{point}", "routed data points accepted"
)
PROCESSOR_POINTS_REJECTED = Signal(
    "otel_gpu.processor.points.rejected",
    COUNTER,
    "{point}",
    "routed data points rejected (NaN, inf, bad timestamps)",
)
PROCESSOR_POINTS_OVERFLOW = Signal(
    "otel_gpu.processor.points.overflow",
    COUNTER,
    "{point}",
    "data points of subjects refused by the series caps",
)
PROCESSOR_SUBJECTS = Signal(
    "otel_gpu.processor.subjects", GAUGE, "{subject}", "detection subjects tracked"
)
PROCESSOR_FORWARD_SENT = Signal(
    "otel_gpu.processor.forward.sent", COUNTER, "{request}", "requests delivered downstream"
)
PROCESSOR_FORWARD_DROPPED = Signal(
    "otel_gpu.processor.forward.dropped",
    COUNTER,
    "{request}",
    "requests lost for this downstream (counted, never silent)",
)
PROCESSOR_FORWARD_PARTIAL_REJECTED = Signal(
    "otel_gpu.processor.forward.partial_rejected",
    COUNTER,
    "{item}",
    "items the downstream rejected in partial_success",
)
PROCESSOR_QUEUE_SIZE = Signal(
    "otel_gpu.processor.forward.queue.size", GAUGE, "{request}", "requests queued"
)
PROCESSOR_QUEUE_BYTES = Signal(
    "otel_gpu.processor.forward.queue.bytes", GAUGE, "By", "bytes queued"
)
PROCESSOR_STORE_ERRORS = Signal(
    "otel_gpu.processor.store.errors", COUNTER, "{error}", "state store write failures"
)
PROCESSOR_MEMORY_USAGE = Signal("otel_gpu.processor.memory.usage", GAUGE, "By", "resident memory")
PROCESSOR_MEMORY_LIMITED = Signal(
    "otel_gpu.processor.memory.limited", GAUGE, "1", "1 while refusing for memory"
)
