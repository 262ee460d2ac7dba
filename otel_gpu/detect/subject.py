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

SUBJECT_KIND = "otel_gpu.subject.kind"
SUBJECT_NAME = "otel_gpu.subject"

# Subject kinds (the values of otel_gpu.subject.kind).
GPU = "gpu"  # one GPU: device memory, utilization, power, temperature, errors
PROCESS_GPU = "process_gpu"  # one process's memory on one GPU
PROCESS_RSS = "process_rss"  # one process's resident host memory
TORCH = "torch"  # torch allocator bytes of one process (on one device when known)

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
        attrs.append(("gpu.index", int(hw_id[len(GPU_INDEX_PREFIX) :])))
    elif hw_id is not None:
        attrs.append(("hw.id", hw_id))
    if pid is not None:
        attrs.append(("process.pid", pid))
    attrs.append((SUBJECT_NAME, local_name(kind, hw_id, pid)))
    return tuple(attrs)
