"""Which pod each GPU of the node belongs to (``--pod-resources``, the node-wide DaemonSet).

Every refresh (on its own thread, never in an OTel callback) pairs the latest snapshot with:

* the kubelet's PodResources ``List`` — the GPUs and MIG devices allocated to each container,
  whether or not a process uses them; GPUs no pod holds but whose memory a process holds are
  *orphaned* (the process outlived its pod, or runs outside Kubernetes);
* else (socket missing, refused or hung: one warning) the cgroup of each process on a GPU,
  which names its pod's UID and container ID, for the GPUs in use only.

In a sidecar given the socket, :func:`kubelet_pod_devices` (``Get``) names the pod's own GPUs.

Exported as ``otel_gpu.gpu.allocated`` (1 per GPU and container; ``otel_gpu.gpu.in_use`` says
whether a process holds it) and ``otel_gpu.gpu.memory.orphaned`` (By, per GPU and process). Both
carry ``hw.id``, so the per-GPU series join them on it (an info metric, as kube_pod_info is).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.k8s.pod import read_cgroup
from otel_gpu.k8s.podresources import Allocation, PodResourcesClient
from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.k8s")

Row = tuple[float, dict[str, Any]]
SOURCE_PODRESOURCES = "podresources"
SOURCE_CGROUP = "cgroup"


class NodeAttribution:
    """GPU → pod rows, refreshed from the latest snapshot every ``period_s``."""

    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        socket_path: str,
        *,
        proc_root: str = "/proc",
        period_s: float = 10.0,
        timeout_s: float = 2.0,
    ) -> None:
        self._latest = latest
        self.socket_path = socket_path
        self._proc_root = proc_root
        self._period_s = period_s
        self._client = PodResourcesClient(socket_path, timeout_s)
        self.source: str | None = None  # where the last refresh's attribution came from
        self.allocated: list[Row] = []
        self.orphaned: list[Row] = []
        self._degraded_reason: str | None = None
        self._orphans_logged: set[tuple[int, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """One round: List (or cgroups) against the latest snapshot; replaces the rows."""
        snap = self._latest()
        if snap is None:
            return
        allocations = self._list()
        if allocations is None:
            self.allocated, self.orphaned = self._from_cgroups(snap), []
            self.source = SOURCE_CGROUP
        else:
            self.allocated, self.orphaned = self._from_allocations(snap, allocations)
            self.source = SOURCE_PODRESOURCES

    def _list(self) -> list[Allocation] | None:
        if not os.path.exists(self.socket_path):
            reason = "it does not exist (mount /var/lib/kubelet/pod-resources)"
        else:
            try:
                found = self._client.gpu_allocations()
            except Exception as exc:  # grpc.RpcError: refused, hung (deadline), not a kubelet
                code = getattr(exc, "code", None)
                reason = str(code() if callable(code) else type(exc).__name__)
            else:
                if self._degraded_reason is not None:
                    log.info("pod-resources socket %s answers again", self.socket_path)
                self._degraded_reason = None
                return found
        if self._degraded_reason is None:
            log.warning(
                "pod-resources socket %s not usable: %s; attributing GPUs through the cgroups "
                "of their processes (pod UID and container ID only)",
                self.socket_path,
                reason,
            )
        self._degraded_reason = reason
        return None

    def _from_allocations(
        self, snap: Snapshot, allocations: list[Allocation]
    ) -> tuple[list[Row], list[Row]]:
        by_index = {str(g.index): g.uuid for g in snap.gpus if g.parent is None}
        used = {gp.gpu_uuid for gp in snap.gpu_processes}
        allocated: list[Row] = []
        held: set[str] = set()
        for a in allocations:
            uuid = by_index.get(a.device_id, a.device_id)  # the plugin's index strategy
            held.add(uuid)
            attrs = {
                "hw.id": uuid,
                "k8s.pod.name": a.pod,
                "k8s.namespace.name": a.namespace,
                "k8s.container.name": a.container,
                "otel_gpu.gpu.in_use": uuid in used,
            }
            allocated.append((1.0, attrs))
        # A GPU whose MIG devices are allocated is held too (its lists aggregate theirs).
        held |= {g.parent for g in snap.gpus if g.parent is not None and g.uuid in held}
        orphaned: list[Row] = []
        for gp in snap.gpu_processes:
            if gp.gpu_uuid in held or not gp.used_memory:
                continue
            orphaned.append((float(gp.used_memory), {"hw.id": gp.gpu_uuid, "process.pid": gp.pid}))
            if (gp.pid, gp.gpu_uuid) not in self._orphans_logged:
                self._orphans_logged.add((gp.pid, gp.gpu_uuid))
                log.warning(
                    "GPU %s: process %s holds %d bytes but no pod is allocated this GPU "
                    "(its pod is gone, or it runs outside Kubernetes)",
                    gp.gpu_uuid,
                    gp.pid,
                    gp.used_memory,
                )
        return allocated, orphaned

    def _from_cgroups(self, snap: Snapshot) -> list[Row]:
        rows: dict[tuple[str, str], Row] = {}
        for gp in snap.gpu_processes:
            found = read_cgroup(gp.pid, self._proc_root).as_dict()
            uid = found.get("k8s.pod.uid")
            if uid is None or (gp.gpu_uuid, uid) in rows:
                continue
            attrs: dict[str, Any] = {"hw.id": gp.gpu_uuid, **found, "otel_gpu.gpu.in_use": True}
            rows[(gp.gpu_uuid, uid)] = (1.0, attrs)
        return list(rows.values())

    # -- thread and instruments ---------------------------------------------------------------

    def start(self) -> NodeAttribution:
        self._thread = threading.Thread(target=self._loop, name="otel-gpu-k8s", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug here must not end attribution for good
                log.exception("GPU attribution failed")
            self._stop.wait(self._period_s)

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._client.close()

    def register_instruments(self, meter: Meter) -> None:
        meter.create_observable_gauge(
            "otel_gpu.gpu.allocated",
            callbacks=[self._observe(lambda: self.allocated)],
            unit="1",
            description="1 per GPU and the container it is allocated to (k8s.* attributes)",
        )
        meter.create_observable_up_down_counter(
            "otel_gpu.gpu.memory.orphaned",
            callbacks=[self._observe(lambda: self.orphaned)],
            unit="By",
            description="GPU memory held by a process on a GPU no pod is allocated",
        )

    @staticmethod
    def _observe(rows: Callable[[], list[Row]]) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(_options: CallbackOptions) -> list[Observation]:
            return [Observation(value, attrs) for value, attrs in rows()]

        return observe


def kubelet_pod_devices(
    socket_path: str, env: Mapping[str, str], timeout_s: float = 2.0
) -> str | None:
    """The GPUs the kubelet allocated to this pod (``Get``), in ``CUDA_VISIBLE_DEVICES`` syntax.

    The pod is named by the downward API (``K8S_POD_NAME``, ``K8S_NAMESPACE_NAME``). None when
    it is not, or when the kubelet cannot say (logged once): the caller falls back to the
    environment of the pod's processes.
    """
    name, namespace = env.get("K8S_POD_NAME", ""), env.get("K8S_NAMESPACE_NAME", "")
    if not name or not namespace:
        return None
    client = PodResourcesClient(socket_path, timeout_s)
    try:
        found = client.pod_gpus(name, namespace) if os.path.exists(socket_path) else None
    except Exception as exc:  # grpc.RpcError: no such pod, refused, hung
        code = getattr(exc, "code", None)
        log.warning(
            "the kubelet at %s did not list pod %s/%s (%s); taking its GPUs from its processes",
            socket_path,
            namespace,
            name,
            code() if callable(code) else type(exc).__name__,
        )
        found = None
    finally:
        client.close()
    return ",".join(a.device_id for a in found) if found else None
