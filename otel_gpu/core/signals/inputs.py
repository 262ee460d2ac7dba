"""What the detection engine reads: which points of which signal feed which
:class:`~otel_gpu.detect.model.Point` field of which subject kind.

The agent's points (``otel_gpu/agent/points.py``), the processor's routes
(``otel_gpu/processor/decode.py``) and the test generators all derive from :data:`FEEDS`, so a
renamed instrument cannot leave the processor's detection blind while every test stays green.
"""

from dataclasses import dataclass
from typing import Any

from otel_gpu.core.signals.attributes import (
    ERROR_TYPE,
    GPU,
    GPU_TASK,
    JOB,
    PROCESS_GPU,
    PROCESS_RSS,
    TORCH,
    XID_CLASS,
)
from otel_gpu.core.signals.gpu import (
    GPU_ERRORS,
    GPU_MEMORY_LIMIT,
    GPU_MEMORY_USAGE,
    GPU_POWER,
    GPU_POWER_LIMIT,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    GPU_XID,
    GPU_XID_LAST,
)
from otel_gpu.core.signals.model import Signal
from otel_gpu.core.signals.process import PROCESS_GPU_MEMORY, PROCESS_MEMORY
from otel_gpu.core.signals.training import (
    TORCH_ALLOCATED,
    TRAINING_GRAD_NORM,
    TRAINING_LOSS,
    TRAINING_PHASE,
    TRAINING_STEP,
)

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
    Feed(GPU_XID, GPU, "xid_reset", (XID_CLASS, ("reset",))),
    Feed(GPU_XID, GPU, "xid_severe", (XID_CLASS, ("severe",))),
    Feed(GPU_XID_LAST, GPU, "xid_last"),
    Feed(PROCESS_GPU_MEMORY, PROCESS_GPU, "used_bytes"),
    Feed(GPU_MEMORY_LIMIT, PROCESS_GPU, "limit_bytes", how=OF_GPU),
    Feed(PROCESS_MEMORY, PROCESS_RSS, "used_bytes"),
    Feed(TORCH_ALLOCATED, TORCH, "used_bytes"),
    Feed(TRAINING_STEP, JOB, "step"),
    Feed(TRAINING_PHASE, JOB, "phase"),
    # The numerics detector's (the in-process agent reads them per step, NaN included; the
    # processor sees the finite values the gauges carry).
    Feed(TRAINING_LOSS, JOB, "loss"),
    Feed(TRAINING_GRAD_NORM, JOB, "grad_norm"),
)


def feeds(subject: str, how: str = VALUE) -> tuple[Feed, ...]:
    """The feeds of one subject kind, of one kind of reading."""
    return tuple(f for f in FEEDS if f.subject == subject and f.how == how)
