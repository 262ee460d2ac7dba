"""Training progress and torch's allocator, reported by the trainer's own process
(``otel_gpu/tracing/progress.py``)."""

from otel_gpu.core.signals.model import GAUGE, UPDOWN, Signal

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
