"""The signal contract: every metric the project exports or reads, declared once.

Each :class:`Signal` is a name with its instrument kind, UCUM unit and description (names are a
contract: the README's Metrics tables). The attribute keys that identify a series are constants here too. The
:data:`FEEDS` say which points of which signal the detection engine reads, into which
:class:`~otel_gpu.detect.model.Point` field of which subject kind: the agent's instrument table
(``metrics.py``), the agent's points (``points.py``), the processor's routes
(``processor/decode.py``) and the test generators all derive from these declarations, so a
renamed instrument cannot leave the processor's detection blind while every test stays green.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import Meter

# Instrument kinds (all observable: every value is read from a sweep or a counter).
GAUGE = "gauge"
COUNTER = "counter"  # monotonic
UPDOWN = "updowncounter"

# -- attribute keys -----------------------------------------------------------------------------

HW_ID = "hw.id"  # GPU UUID
HW_TYPE = "hw.type"
HW_VENDOR = "hw.vendor"
HW_NAME = "hw.name"
HW_PARENT = "hw.parent"  # the physical GPU of a MIG instance
HW_STATE = "hw.state"
GPU_INDEX = "gpu.index"
GPU_TASK = "hw.gpu.task"  # general, encoder, decoder
ERROR_TYPE = "error.type"  # corrected, uncorrected, xid
CLOCK_DOMAIN = "otel_gpu.clock.domain"
IO_DIRECTION = "network.io.direction"
THROTTLE_REASON = "otel_gpu.throttle.reason"
PROCESS_PID = "process.pid"
PROCESS_VPID = "process.vpid"  # the PID inside the job's namespace, when it differs
PROCESS_PARENT_PID = "process.parent_pid"
PROCESS_EXECUTABLE = "process.executable.name"
PROCESS_COMMAND = "process.command"
PROCESS_OWNER = "process.owner"
PHASE = "training.phase"  # on training.phase points: the phase the point is about
SUBJECT_KIND = "otel_gpu.subject.kind"  # on detector outputs: what a subject is (below)
SUBJECT_NAME = "otel_gpu.subject"  # a subject's short name (detect/subject.py)

# Subject kinds (the values of otel_gpu.subject.kind).
GPU = "gpu"  # one GPU: device memory, utilization, power, temperature, errors
PROCESS_GPU = "process_gpu"  # one process's memory on one GPU
PROCESS_RSS = "process_rss"  # one process's resident host memory
TORCH = "torch"  # torch allocator bytes of one process (on one device when known)
JOB = "job"  # a reporter's job: its phase and step apply to all its subjects (not a subject)

# Detector outputs: attributes of alert and transition records (span events, log records).
ALERT_EVENT = "otel_gpu.alert"
TRANSITION_EVENT = "otel_gpu.breaker.transition"
ALERT_KIND = "otel_gpu.alert.kind"
ALERT_SUBJECT = "otel_gpu.alert.subject"
ALERT_SEVERITY = "otel_gpu.alert.severity"
ALERT_MESSAGE = "otel_gpu.alert.message"
ALERT_TIME = "otel_gpu.alert.time"
ALERT_WINDOW = "otel_gpu.alert.window"  # s
ALERT_CONFIDENCE = "otel_gpu.alert.confidence"  # 0..1
ALERT_EVIDENCE = "otel_gpu.alert.evidence."  # prefix of each evidence item
ALERT_DIAGNOSIS = "otel_gpu.alert.diagnosis"  # string[]: where and why, most telling first
ALERT_DIAGNOSIS_KIND = "otel_gpu.alert.diagnosis.kind"  # which diagnosis ran (memory, stall, ...)
BREAKER_SUBJECT = "otel_gpu.breaker.subject"
BREAKER_FROM = "otel_gpu.breaker.from_state"
BREAKER_TO = "otel_gpu.breaker.to_state"
BREAKER_EPISODE = "otel_gpu.breaker.episode"
BREAKER_TIME = "otel_gpu.breaker.time"


@dataclass(frozen=True)
class Signal:
    """One metric: its name, instrument kind, unit (UCUM) and description."""

    name: str
    kind: str
    unit: str
    description: str


# -- the agent's GPU signals (NVML) --------------------------------------------------------------

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
GPU_TEMPERATURE = Signal("hw.temperature", GAUGE, "Cel", "GPU core temperature")
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
GPU_CLOCK = Signal("otel_gpu.gpu.clock.frequency", GAUGE, "Hz", "GPU clock frequencies by domain")
GPU_PCIE = Signal("otel_gpu.gpu.pcie.throughput", GAUGE, "By/s", "PCIe throughput by direction")
GPU_THROTTLE = Signal(
    "otel_gpu.gpu.throttle",
    GAUGE,
    "1",
    "1 while a clocks-event (throttle) reason is active, 0 after it cleared",
)

# -- the agent's process signals (NVML and /proc) ------------------------------------------------

PROCESS_GPU_MEMORY = Signal(
    "process.gpu.memory.usage", UPDOWN, "By", "GPU memory used by a process on one GPU"
)
PROCESS_GPU_UTILIZATION = Signal(
    "process.gpu.utilization",
    GAUGE,
    "1",
    "Fraction of time a process ran kernels on one GPU (NVML samples)",
)
PROCESS_CPU_UTILIZATION = Signal(
    "process.cpu.utilization", GAUGE, "1", "CPU time / elapsed time / CPUs available"
)
PROCESS_MEMORY = Signal("process.memory.usage", UPDOWN, "By", "Resident memory")
PROCESS_MEMORY_VIRTUAL = Signal("process.memory.virtual", UPDOWN, "By", "Virtual memory")
PROCESS_THREADS = Signal("process.thread.count", UPDOWN, "{thread}", "Threads")
PROCESS_FDS = Signal(
    "process.unix.file_descriptor.count", UPDOWN, "{file_descriptor}", "Open file descriptors"
)
PROCESSES_DROPPED = Signal(
    "otel_gpu.agent.processes.dropped",
    GAUGE,
    "{process}",
    "Processes not tracked in the last sweep because of OTEL_GPU_MAX_PROCESSES",
)

# -- training progress and torch's allocator (reported by the trainer's own process) -------------

TRAINING_STEP = Signal(
    "training.step", GAUGE, "{step}", "Global training step (optimizer steps completed)."
)
TRAINING_PHASE = Signal(
    "training.phase",
    UPDOWN,
    "1",
    "1 for the current training phase (load, train, evaluate, save), 0 for the others.",
)
TORCH_ALLOCATED = Signal(
    "torch.cuda.memory.allocated",
    UPDOWN,
    "By",
    "Bytes held by live tensors in torch's CUDA caching allocator.",
)
TORCH_RESERVED = Signal(
    "torch.cuda.memory.reserved",
    UPDOWN,
    "By",
    "Bytes reserved from the device by torch's CUDA caching allocator.",
)
TORCH_PEAK = Signal(
    "torch.cuda.memory.peak",
    GAUGE,
    "By",
    "Peak bytes held by live tensors since start or the last peak reset.",
)

# -- detector outputs (the agent's watchdog and the processor) -----------------------------------

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

# Every Signal declared above, read off the module so that a new one cannot be left out.
SIGNALS: tuple[Signal, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Signal))
BY_NAME: dict[str, Signal] = {s.name: s for s in SIGNALS}

# -- what the engine reads -------------------------------------------------------------------------

# How a feed's points become a Point field.
VALUE = "value"  # the point's value
COUNT = "count"  # each series present at a time adds one (processes holding a GPU)
OF_GPU = "of_gpu"  # the value of the subject's GPU (a process's memory limit)


@dataclass(frozen=True)
class Feed:
    """Points of ``signal`` that the engine reads as ``field`` of a ``subject``'s Point.

    ``select``: (attribute key, accepted values) when only some of the signal's series feed the
    field; ``None`` among the values accepts a point without the attribute.
    """

    signal: Signal
    subject: str  # a subject kind (detect.subject) or JOB
    field: str  # a Point field
    select: tuple[str, tuple[str | None, ...]] | None = None
    how: str = VALUE

    def accepts(self, attrs: dict[str, Any]) -> bool:
        """Whether a series with these point attributes feeds the field."""
        if self.select is None:
            return True
        key, values = self.select
        return attrs.get(key) in values


FEEDS: tuple[Feed, ...] = (
    Feed(GPU_MEMORY_USAGE, GPU, "used_bytes"),
    Feed(GPU_MEMORY_LIMIT, GPU, "limit_bytes"),
    Feed(GPU_UTILIZATION, GPU, "util", (GPU_TASK, ("general", None))),
    Feed(PROCESS_GPU_MEMORY, GPU, "procs", how=COUNT),
    Feed(GPU_POWER, GPU, "power_w"),
    Feed(GPU_POWER_LIMIT, GPU, "power_limit_w"),
    Feed(GPU_TEMPERATURE, GPU, "temperature_c"),
    Feed(GPU_ERRORS, GPU, "ecc_uncorrected", (ERROR_TYPE, ("uncorrected",))),
    Feed(GPU_ERRORS, GPU, "xid_errors", (ERROR_TYPE, ("xid",))),
    Feed(PROCESS_GPU_MEMORY, PROCESS_GPU, "used_bytes"),
    Feed(GPU_MEMORY_LIMIT, PROCESS_GPU, "limit_bytes", how=OF_GPU),
    Feed(PROCESS_MEMORY, PROCESS_RSS, "used_bytes"),
    Feed(TORCH_ALLOCATED, TORCH, "used_bytes"),
    Feed(TRAINING_STEP, JOB, "step"),
    Feed(TRAINING_PHASE, JOB, "phase"),
)


def feeds(subject: str, how: str = VALUE) -> tuple[Feed, ...]:
    """The feeds of one subject kind, of one kind of reading."""
    return tuple(f for f in FEEDS if f.subject == subject and f.how == how)


def observable(meter: Meter, signal: Signal, callbacks: Sequence[Callable[..., Any]]) -> Any:
    """Create the observable instrument of ``signal``'s kind, name, unit and description."""
    make = {
        GAUGE: meter.create_observable_gauge,
        COUNTER: meter.create_observable_counter,
        UPDOWN: meter.create_observable_up_down_counter,
    }[signal.kind]
    return make(
        signal.name, callbacks=list(callbacks), unit=signal.unit, description=signal.description
    )
