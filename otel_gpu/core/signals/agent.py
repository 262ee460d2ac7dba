"""The agent's own health (``otel_gpu.agent.*``): how fresh sampling is, what it costs, what
NVML refused and what the exporter could not deliver (``otel_gpu/agent/selfmetrics.py``; the
dropped processes are counted by the sweep, ``otel_gpu/agent/instruments.py``)."""

from otel_gpu.core.signals.model import COUNTER, GAUGE, Signal

PROCESSES_DROPPED = Signal(
    "otel_gpu.agent.processes.dropped",
    GAUGE,
    "{process}",
    "Processes not tracked in the last sweep because of OTEL_GPU_MAX_PROCESSES",
)
AGENT_SWEEP_DURATION = Signal(
    "otel_gpu.agent.sweep.duration", GAUGE, "s", "Wall time of the last NVML + /proc sweep"
)
AGENT_GPU_READ_DURATION = Signal(
    "otel_gpu.agent.gpu.read.duration",
    GAUGE,
    "s",
    "Wall time the last sweep spent reading each GPU (hw.id); left out for a GPU whose read "
    "was abandoned (hung) or that is lost",
)
AGENT_SNAPSHOT_AGE = Signal(
    "otel_gpu.agent.snapshot.age",
    GAUGE,
    "s",
    "Seconds since the last snapshot arrived (since start before the first); above 3 "
    "sampling intervals the device and process metrics are not exported (stale)",
)
AGENT_NVML_ERRORS = Signal(
    "otel_gpu.agent.nvml.errors",
    COUNTER,
    "{error}",
    "NVML call failures by error name (error.type), since the agent started",
)
AGENT_SAMPLER_RESTARTS = Signal(
    "otel_gpu.agent.sampler.restarts",
    COUNTER,
    "{restart}",
    "Sampling helper processes restarted after a crash, exit or hang",
)
AGENT_EXPORT_FAILURES = Signal(
    "otel_gpu.agent.export.failures",
    COUNTER,
    "{export}",
    "Metric exports that failed (collector down, refused, timed out)",
)
AGENT_EXPORT_DROPPED_POINTS = Signal(
    "otel_gpu.agent.export.dropped_points",
    COUNTER,
    "{point}",
    "Data points in failed metric exports (lost)",
)
AGENT_SAMPLING_INTERVAL = Signal(
    "otel_gpu.agent.sampling.interval",
    GAUGE,
    "s",
    "Effective interval of each kind of read (otel_gpu.read: gpu, process_details, "
    "process_gpu_util): longer than the sampling interval while OTEL_GPU_CPU_BUDGET backs off",
)
AGENT_EXPORT_REJECTED_POINTS = Signal(
    "otel_gpu.agent.export.rejected_points",
    COUNTER,
    "{point}",
    "Data points a collector rejected in a partial success (not sent again)",
)
