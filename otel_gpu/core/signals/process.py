"""The agent's per-process signals: GPU memory and utilization from NVML, the rest from
``/proc`` (``otel_gpu/sampling/procs.py``)."""

from otel_gpu.core.signals.model import GAUGE, UPDOWN, Signal

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
    "process.cpu.utilization",
    GAUGE,
    "1",
    "CPU time / elapsed time / CPUs available, by cpu.mode (user, system)",
)
PROCESS_MEMORY = Signal("process.memory.usage", UPDOWN, "By", "Resident memory")
PROCESS_MEMORY_VIRTUAL = Signal("process.memory.virtual", UPDOWN, "By", "Virtual memory")
PROCESS_THREADS = Signal("process.thread.count", UPDOWN, "{thread}", "Threads")
PROCESS_FDS = Signal(
    "process.unix.file_descriptor.count", UPDOWN, "{file_descriptor}", "Open file descriptors"
)
