"""The agent's GPU signals, read from NVML (``otel_gpu/sampling/nvml.py``)."""

from otel_gpu.core.signals.model import COUNTER, GAUGE, UPDOWN, Signal

GPU_UTILIZATION = Signal(
    "hw.gpu.utilization",
    GAUGE,
    "1",
    "Fraction of time the GPU ran work, by task (general = any kernel, encoder, decoder)",
)
GPU_MEMORY_USAGE = Signal("hw.gpu.memory.usage", UPDOWN, "By", "GPU memory in use")
GPU_MEMORY_LIMIT = Signal("hw.gpu.memory.limit", UPDOWN, "By", "GPU memory in total")
GPU_MEMORY_UTILIZATION = Signal(
    "hw.gpu.memory.utilization", GAUGE, "1", "Fraction of GPU memory in use (usage / limit)"
)
GPU_MEMORY_RESERVED = Signal(
    "otel_gpu.gpu.memory.reserved",
    UPDOWN,
    "By",
    "GPU memory reserved by the driver (included in usage)",
)
GPU_MEMORY_CONTROLLER = Signal(
    "otel_gpu.gpu.memory_controller.utilization",
    GAUGE,
    "1",
    "Fraction of time device memory was read or written (NVML 'memory' utilization)",
)
GPU_POWER = Signal("hw.power", GAUGE, "W", "GPU power draw")
GPU_POWER_LIMIT = Signal("otel_gpu.gpu.power.limit", GAUGE, "W", "Enforced GPU power limit")
GPU_ENERGY = Signal("hw.energy", COUNTER, "J", "GPU energy since the driver loaded")
GPU_TEMPERATURE = Signal(
    "hw.temperature", GAUGE, "Cel", "GPU core temperature (hw.sensor_location = gpu)"
)
GPU_TEMPERATURE_LIMIT = Signal(
    "hw.temperature.limit",
    GAUGE,
    "Cel",
    "GPU temperature thresholds by hw.limit_type: throttled (the driver slows the GPU down) "
    "and high.critical (it shuts the GPU down)",
)
GPU_ERRORS = Signal(
    "hw.errors",
    COUNTER,
    "{error}",
    "GPU errors: ECC corrected and uncorrected (volatile), Xid events seen by the agent",
)
GPU_STATUS = Signal("hw.status", UPDOWN, "1", "GPU status: 1 for the current hw.state")
GPU_XID_LAST = Signal(
    "otel_gpu.gpu.xid.last",
    GAUGE,
    "{code}",
    "Code of the last Xid event seen on the GPU, reported beside hw.status once the GPU is "
    "lost (79: fallen off the bus)",
)
GPU_XID = Signal(
    "otel_gpu.gpu.xid",
    COUNTER,
    "{event}",
    "Xid events seen on the GPU by what they mean (NVIDIA's Xid catalog): application, reset "
    "or severe",
)
GPU_CLOCK = Signal("otel_gpu.gpu.clock.frequency", GAUGE, "Hz", "GPU clock frequencies by domain")
GPU_PCIE = Signal("otel_gpu.gpu.pcie.throughput", GAUGE, "By/s", "PCIe throughput by direction")
GPU_THROTTLE = Signal(
    "otel_gpu.gpu.throttle",
    GAUGE,
    "1",
    "1 while a clocks-event (throttle) reason is active, 0 after it cleared",
)
