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
TRAINING_LOSS = Signal(
    "training.loss", GAUGE, "1", "Training loss of the last step that logged one."
)
TRAINING_LEARNING_RATE = Signal(
    "training.learning_rate", GAUGE, "1", "Learning rate of the last step that logged one."
)
TRAINING_GRAD_NORM = Signal(
    "training.grad_norm", GAUGE, "1", "Gradient norm of the last step that logged one."
)
TRAINING_STEP_DURATION = Signal(
    "training.step.duration", GAUGE, "s", "Seconds per optimizer step, over the last step."
)
TRAINING_STEP_COLLECTIVE_WAIT = Signal(
    "training.step.collective_wait",
    GAUGE,
    "s",
    "Seconds the last optimizer step waited in blocking torch.distributed collectives (CPU-side).",
)
TRAINING_STEP_WORK = Signal(
    "training.step.work",
    GAUGE,
    "s",
    "Seconds the last optimizer step worked: its duration less its collective wait.",
)
TRAINING_SAMPLES_RATE = Signal(
    "training.samples.rate",
    GAUGE,
    "{sample}/s",
    "Samples per second over the last step (when the trainer says how many a step takes).",
)
TRAINING_TOKENS_RATE = Signal(
    "training.tokens.rate",
    GAUGE,
    "{token}/s",
    "Tokens per second over the last step (when the trainer says how many a step takes).",
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
MEMTRACKER_USED = Signal(
    "otel_gpu.memtracker.used",
    GAUGE,
    "By",
    "Memory a MemTracker saw at its last sample (allocator bytes, or RSS on CPU builds).",
)
MEMTRACKER_PEAK = Signal(
    "otel_gpu.memtracker.peak",
    GAUGE,
    "By",
    "The highest memory a MemTracker sampled since it started.",
)
