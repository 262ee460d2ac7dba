"""The attribute keys that identify a series, the subject kinds, and the keys of the detector
outputs' records (alert and transition span events and log records)."""

HW_ID = "hw.id"  # GPU UUID
HW_TYPE = "hw.type"
HW_VENDOR = "hw.vendor"
HW_NAME = "hw.name"  # short: GPU0, or GPU0 MIG 3g.40gb (semconv: an easily-recognizable name)
HW_MODEL = "hw.model"  # the product name NVML reports, e.g. NVIDIA H100 80GB HBM3
HW_DRIVER_VERSION = "hw.driver_version"
HW_FIRMWARE_VERSION = "hw.firmware_version"  # the VBIOS version
HW_SERIAL_NUMBER = "hw.serial_number"
HW_SENSOR_LOCATION = "hw.sensor_location"  # on hw.temperature*: gpu (NVML's GPU die sensor)
HW_LIMIT_TYPE = "hw.limit_type"  # on hw.temperature.limit: high.critical, throttled
HW_PARENT = "hw.parent"  # the physical GPU of a MIG instance
HW_STATE = "hw.state"
GPU_INDEX = "gpu.index"
GPU_TASK = "hw.gpu.task"  # general, encoder, decoder
XID_CLASS = "otel_gpu.xid.class"  # application, reset, severe (otel_gpu/core/xid.py)
AGENT_READ = "otel_gpu.read"  # a kind of read of the sampler (adaptive sampling)
ERROR_TYPE = "error.type"  # corrected, uncorrected, xid; an NVML error name on self-metrics
CLOCK_DOMAIN = "otel_gpu.clock.domain"
IO_DIRECTION = "network.io.direction"
THROTTLE_REASON = "otel_gpu.throttle.reason"
PROCESS_PID = "process.pid"
PROCESS_VPID = "process.vpid"  # the PID inside the job's namespace, when it differs
PROCESS_PARENT_PID = "process.parent_pid"
PROCESS_EXECUTABLE = "process.executable.name"
PROCESS_COMMAND = "process.command"  # argv[0]
PROCESS_COMMAND_LINE = "process.command_line"  # as OTEL_GPU_PROCESS_COMMAND asks
PROCESS_CREATION_TIME = (
    "process.creation.time"  # ISO 8601: with process.pid, tells reused PIDs apart
)
CPU_MODE = "cpu.mode"  # user, system
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
