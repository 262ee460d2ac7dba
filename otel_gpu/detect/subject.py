"""One identity for a detection subject, the same in the agent and the processor.

A subject is identified by attributes, not by a sentence: its kind (``otel_gpu.subject.kind``),
the GPU (``hw.id``, or ``gpu.index`` where only the index is known) and the process
(``process.pid``) on the data point, and the reporter's resource identity (``service.*``,
``host.*``, ...) on the resource. The agent exports its detector outputs under its own resource,
and the processor puts a subject's outputs under the resource of whoever reported its data, so
the same GPU or process carries the same attributes from both. ``otel_gpu.subject`` is the
short name built from the same parts (``gpu:<uuid>``, ``process:<pid>@<uuid>``, ``rss:<pid>``),
for people reading a dashboard.
"""

from __future__ import annotations

from otel_gpu.core.signals import (
    GPU,
    GPU_INDEX,
    HW_ID,
    PROCESS_GPU,
    PROCESS_PID,
    PROCESS_RSS,
    SUBJECT_KIND,
    SUBJECT_NAME,
    TORCH,
)

__all__ = ["GPU", "PROCESS_GPU", "PROCESS_RSS", "SUBJECT_KIND", "SUBJECT_NAME", "TORCH"]

_PREFIX = {GPU: "gpu", PROCESS_GPU: "process", PROCESS_RSS: "rss", TORCH: "torch"}
GPU_INDEX_PREFIX = "gpu.index="  # a device known only by its index (torch without a UUID)


def local_name(kind: str, hw_id: str | None, pid: int | None) -> str:
    """The subject's short name within its reporter, e.g. ``process:4242@GPU-3f..``."""
    prefix = _PREFIX.get(kind, kind)
    if kind == GPU:
        return f"{prefix}:{hw_id}"
    if pid is None:
        return f"{prefix}:{hw_id}"
    return f"{prefix}:{pid}" if hw_id is None else f"{prefix}:{pid}@{hw_id}"


def subject_attributes(
    kind: str, hw_id: str | None, pid: int | None
) -> tuple[tuple[str, str | int], ...]:
    """The point attributes that identify a subject on every detector output."""
    attrs: list[tuple[str, str | int]] = [(SUBJECT_KIND, kind)]
    if hw_id is not None and hw_id.startswith(GPU_INDEX_PREFIX):
        attrs.append((GPU_INDEX, int(hw_id[len(GPU_INDEX_PREFIX) :])))
    elif hw_id is not None:
        attrs.append((HW_ID, hw_id))
    if pid is not None:
        attrs.append((PROCESS_PID, pid))
    attrs.append((SUBJECT_NAME, local_name(kind, hw_id, pid)))
    return tuple(attrs)
