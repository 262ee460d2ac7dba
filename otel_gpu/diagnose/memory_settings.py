"""Bounds of memory attribution inside the trainer: ``OTEL_GPU_DIAGNOSE_*`` environment >
default, declared once, validated once (a bad value is one UsageError naming the variable).

Read once where the in-process part registers its memory operations
(:mod:`otel_gpu.tracing.memory_ops`) and passed down to :mod:`otel_gpu.diagnose.census`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from otel_gpu.core.settings import Setting, boolean, number, resolve

DECLARED = (
    Setting(
        "memory_enabled", "OTEL_GPU_DIAGNOSE_MEMORY", boolean,
        "serve `memory.census` on the control channel (leak attribution, `diagnose memory`)",
        "`true`",
    ),
    Setting(
        "census_max_objects", "OTEL_GPU_DIAGNOSE_CENSUS_MAX_OBJECTS",
        number(1000, integer=True, accepted="use a whole number of 1000 or more"),
        "objects one census visits at most on its walk from the roots (then it stops, said so)",
        "`1000000`",
    ),
    Setting(
        "census_max_s", "OTEL_GPU_DIAGNOSE_CENSUS_MAX_S",
        number(0.05, 60, accepted="use seconds between 0.05 and 60"),
        "seconds one census walks at most (then it stops, said so)",
        "`5`",
    ),
    Setting(
        "census_max_depth", "OTEL_GPU_DIAGNOSE_CENSUS_MAX_DEPTH",
        number(1, 64, integer=True, accepted="use a whole number between 1 and 64"),
        "references followed from a root at most to reach a tensor",
        "`16`",
    ),
    Setting(
        "census_max_over_s", "OTEL_GPU_DIAGNOSE_CENSUS_MAX_OVER_S",
        number(0, 3600, accepted="use seconds between 0 and 3600"),
        "longest interval one `memory.census` request may measure growth over",
        "`300`",
    ),
    Setting(
        "cuda_history_max_s", "OTEL_GPU_DIAGNOSE_CUDA_HISTORY_MAX_S",
        number(60, 86400, accepted="use seconds between 60 and 86400"),
        "longest the CUDA allocator history stays on between a suspicion and its confirmation",
        "`7200`",
    ),
    Setting(
        "oom_observer", "OTEL_GPU_DIAGNOSE_OOM", boolean,
        "attach PyTorch's CUDA out-of-memory observer (the OOM post-mortem) once CUDA is in use",
        "`true`",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class MemorySettings:
    """Bounds of one census; :data:`DECLARED` documents each field."""

    memory_enabled: bool = True
    census_max_objects: int = 1_000_000
    census_max_s: float = 5.0
    census_max_depth: int = 16
    census_max_over_s: float = 300.0
    cuda_history_max_s: float = 7200.0
    oom_observer: bool = True

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> MemorySettings:
        values, _origin = resolve(DECLARED, env=os.environ if env is None else env)
        return cls(**values)
