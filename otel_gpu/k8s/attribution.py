"""Which pod each GPU and process of the node belongs to (``--pod-resources``, the DaemonSet).

Every refresh (on its own thread, never in an OTel callback) pairs the latest snapshot with:

* the kubelet's PodResources ``List`` — the GPUs and MIG devices allocated to each container,
  whether or not a process uses them; else (socket missing, refused or hung: one warning) the
  processes' cgroups alone;
* the cgroup of every process of the snapshot (pod UID and container ID; read once per
  process, by PID and start time);
* the node's ``/var/log/pods`` directories (``--pod-logs``): pod UID -> namespace and name,
  and which pods the node still runs.

The pairing (otel_gpu/k8s/node_map.py) gives the labels every per-GPU and per-process series
carries (:meth:`NodeAttribution.series_labels`, looked up by the metric callbacks),
``otel_gpu.gpu.allocated`` (1 per GPU and container; ``otel_gpu.gpu.in_use`` says whether a
process holds it) and ``otel_gpu.gpu.memory.orphaned`` (By, per GPU and process, with
``otel_gpu.orphan.reason``: ``no_pod`` on a GPU no pod holds, ``pod_gone`` for a process of a
pod the node no longer runs, whichever GPU it is on).

In a sidecar given the socket, :func:`kubelet_pod_devices` (``Get``) names the pod's own GPUs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.agent.labels import NO_LABELS, SeriesLabels
from otel_gpu.core import signals as sig
from otel_gpu.core.signals import observable
from otel_gpu.k8s.node_map import POD_UID, Identity, Row, map_node
from otel_gpu.k8s.pod import read_cgroup
from otel_gpu.k8s.podlogs import PodDir, read_pod_logs
from otel_gpu.k8s.podresources import Allocation, PodResourcesClient
from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.k8s")

SOURCE_PODRESOURCES = "podresources"
SOURCE_CGROUP = "cgroup"
FIRST_REFRESH_POLL_S = 0.5  # until the first snapshot exists: labels from the first points on

ProcessKey = tuple[int, int | None]  # PID and start time: a reused PID is read again


class NodeAttribution:
    """GPU and process -> pod, refreshed from the latest snapshot every ``period_s``."""

    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        socket_path: str,
        *,
        proc_root: str = "/proc",
        pod_logs: str | None = None,
        period_s: float = 10.0,
        timeout_s: float = 2.0,
    ) -> None:
        self._latest = latest
        self.socket_path = socket_path
        self._proc_root = proc_root
        self._pod_logs = pod_logs
        self._period_s = period_s
        self._client = PodResourcesClient(socket_path, timeout_s)
        self.source: str | None = None  # where the last refresh's attribution came from
        self.allocated: list[Row] = []
        self.orphaned: list[Row] = []
        self._labels = NO_LABELS
        self._degraded_reason: str | None = None
        self._pod_logs_missing = False
        # Both hold only what the last snapshot holds: bounded by the node's processes.
        self._identities: dict[ProcessKey, Identity] = {}
        self._orphans_logged: set[tuple[int, str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def series_labels(self) -> SeriesLabels:
        """The ``k8s.*`` of each GPU and process series, as of the last refresh."""
        return self._labels

    def refresh(self) -> bool:
        """One round against the latest snapshot; replaces labels and rows (False: no
        snapshot yet)."""
        snap = self._latest()
        if snap is None:
            return False
        allocations = self._list()
        found = map_node(snap, allocations, self._read_identities(snap), self._read_pod_logs())
        self.source = SOURCE_CGROUP if allocations is None else SOURCE_PODRESOURCES
        self.allocated, self.orphaned, self._labels = found.allocated, found.orphaned, found.labels
        self._warn_orphans(found.orphaned)
        return True

    def _read_identities(self, snap: Snapshot) -> dict[int, Identity]:
        """The cgroup identity of every process of the snapshot that runs in a pod."""
        keys: dict[ProcessKey, int] = {(p.pid, p.start_ticks): p.pid for p in snap.processes}
        listed = {p.pid for p in snap.processes}
        for gp in snap.gpu_processes:  # on a GPU but outside the watched tree
            pid = snap.host_to_local.get(gp.pid, gp.pid)
            if pid not in listed:
                listed.add(pid)
                keys[(pid, None)] = pid
        known, fresh = self._identities, {}
        for key, pid in keys.items():
            if key in known and key[1] is not None:
                fresh[key] = known[key]
            else:  # without a start time the PID may be reused: read it again
                fresh[key] = read_cgroup(pid, self._proc_root).as_dict()
        self._identities = fresh
        return {pid: fresh[key] for key, pid in keys.items() if POD_UID in fresh[key]}

    def _read_pod_logs(self) -> dict[str, PodDir] | None:
        if self._pod_logs is None:
            return None
        pods = read_pod_logs(self._pod_logs)
        if pods is None and not self._pod_logs_missing:
            log.warning(
                "pod logs folder %s not readable (mount the node's /var/log/pods): pod names "
                "come from PodResources only, and processes of deleted pods are not found",
                self._pod_logs,
            )
        self._pod_logs_missing = pods is None
        return pods

    def _warn_orphans(self, rows: list[Row]) -> None:
        current = set()
        for value, attrs in rows:
            key = (attrs[sig.PROCESS_PID], attrs[sig.HW_ID], attrs[sig.ORPHAN_REASON])
            current.add(key)
            if key in self._orphans_logged:
                continue
            if key[2] == sig.POD_GONE:
                why = f"its pod {attrs[POD_UID]} no longer runs on this node"
            else:
                why = (
                    "no pod is allocated this GPU (its pod is gone, or it runs outside Kubernetes)"
                )
            log.warning("GPU %s: process %s holds %d bytes but %s", key[1], key[0], value, why)
        self._orphans_logged = current  # once per process while it stays orphaned

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
                "of their processes (pod UID and container ID; names from the pod logs)",
                self.socket_path,
                reason,
            )
        self._degraded_reason = reason
        return None

    # -- thread and instruments ---------------------------------------------------------------

    def start(self) -> NodeAttribution:
        self._thread = threading.Thread(target=self._loop, name="otel-gpu-k8s", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        refreshed = False
        while not self._stop.is_set():
            try:
                refreshed = self.refresh() or refreshed
            except Exception:  # a bug here must not end attribution for good
                log.exception("GPU attribution failed")
            self._stop.wait(self._period_s if refreshed else FIRST_REFRESH_POLL_S)

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._client.close()

    def register_instruments(self, meter: Meter) -> None:
        """``otel_gpu.gpu.allocated`` and ``otel_gpu.gpu.memory.orphaned`` (signals.k8s), read
        from the last refresh's rows."""
        observable(meter, sig.GPU_ALLOCATED, [self._observe(lambda: self.allocated)])
        observable(meter, sig.GPU_MEMORY_ORPHANED, [self._observe(lambda: self.orphaned)])

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
