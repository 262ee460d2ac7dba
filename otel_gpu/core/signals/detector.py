"""Detector outputs: exported by the agent's watchdog (``otel_gpu/agent/watchdog.py``) and by
the processor (``otel_gpu/processor/outputs.py``), the same names from both."""

from otel_gpu.core.signals.model import COUNTER, GAUGE, Signal

LEAK_RATE = Signal(
    "otel_gpu.leak.rate", GAUGE, "By/s", "Memory growth rate of a subject with an active leak"
)
TIME_TO_EXHAUSTION = Signal(
    "otel_gpu.memory.time_to_exhaustion",
    GAUGE,
    "s",
    "Projected time until a leaking subject reaches its memory limit",
)
BREAKER_STATE = Signal(
    "otel_gpu.breaker.state",
    GAUGE,
    "1",
    "Circuit breaker per subject: 0 closed, 1 half-open, 2 open",
)
ALERTS = Signal("otel_gpu.alerts", COUNTER, "{alert}", "Alerts raised, by subject and kind")

DETECTOR_OUTPUTS = (LEAK_RATE, TIME_TO_EXHAUSTION, BREAKER_STATE, ALERTS)
