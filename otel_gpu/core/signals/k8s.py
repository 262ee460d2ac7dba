"""Kubernetes allocation: which pod each GPU is allocated to, and GPU memory no running pod
accounts for (the sidecar's ``--pod-resources``, ``otel_gpu/k8s/attribution.py``)."""

from otel_gpu.core.signals.model import GAUGE, UPDOWN, Signal

GPU_IN_USE = "otel_gpu.gpu.in_use"  # attribute of otel_gpu.gpu.allocated: a process holds it
ORPHAN_REASON = "otel_gpu.orphan.reason"  # attribute of otel_gpu.gpu.memory.orphaned (below)
NO_POD = "no_pod"  # on a GPU no pod is allocated
POD_GONE = "pod_gone"  # its cgroup names a pod the node no longer runs

GPU_ALLOCATED = Signal(
    "otel_gpu.gpu.allocated",
    GAUGE,
    "1",
    "1 per GPU and the container it is allocated to (k8s.* attributes)",
)
GPU_MEMORY_ORPHANED = Signal(
    "otel_gpu.gpu.memory.orphaned",
    UPDOWN,
    "By",
    "GPU memory held by a process on a GPU no pod is allocated (no_pod) or by a process of a "
    "pod the node no longer runs (pod_gone)",
)
