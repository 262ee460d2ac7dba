"""Which pod and container each GPU and process of the node belongs to (pure: no I/O).

Inputs, all read by :class:`otel_gpu.k8s.attribution.NodeAttribution` on its own thread:

* the kubelet's PodResources allocations (None when the socket cannot be read): device ->
  namespace, pod, container (no pod UID);
* each process's cgroup identity (``k8s.pod.uid``, ``container.id``), by the agent's PID;
* the node's ``/var/log/pods`` directories (None when not mounted): pod UID -> namespace,
  name, container names; the UIDs of the pods the node still runs.

Outputs: the per-series labels (every GPU series of a device held by exactly one container
carries that container's ``k8s.*``; every process series its own pod's), the
``otel_gpu.gpu.allocated`` rows and the ``otel_gpu.gpu.memory.orphaned`` rows with their reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.agent.labels import Extra, SeriesLabels
from otel_gpu.core.signals import GPU_IN_USE, NO_POD, ORPHAN_REASON, POD_GONE
from otel_gpu.k8s.podlogs import PodDir
from otel_gpu.k8s.podresources import Allocation
from otel_gpu.sampling.snapshot import Snapshot

Row = tuple[float, dict[str, Any]]
Identity = Mapping[str, str]  # a process's cgroup attributes: k8s.pod.uid, container.id

POD_UID = "k8s.pod.uid"
CONTAINER_ID = "container.id"


@dataclass(frozen=True, slots=True)
class PodRef:
    """What is known of the one container holding a device (or a process's pod)."""

    namespace: str | None = None
    name: str | None = None
    container: str | None = None
    uid: str | None = None

    def attributes(self) -> Extra:
        found = (
            ("k8s.namespace.name", self.namespace),
            ("k8s.pod.name", self.name),
            ("k8s.pod.uid", self.uid),
            ("k8s.container.name", self.container),
        )
        return tuple((k, v) for k, v in found if v)


@dataclass(frozen=True, slots=True)
class NodeMap:
    labels: SeriesLabels = SeriesLabels()
    allocated: list[Row] = field(default_factory=list)
    orphaned: list[Row] = field(default_factory=list)


def device_uuid(device_id: str, by_index: Mapping[str, str]) -> str:
    """A device plugin's ID as the NVML UUID: the ``index`` strategy names GPUs by index, and
    time-slicing shares one GPU as ``<uuid>::<replica>``."""
    base = device_id.split("::", 1)[0]
    return by_index.get(base, base)


def map_node(
    snap: Snapshot,
    allocations: list[Allocation] | None,
    identities: Mapping[int, Identity],
    pods: Mapping[str, PodDir] | None,
) -> NodeMap:
    """Pair one snapshot with what the kubelet, the cgroups and the pod logs say."""
    by_index = {str(g.index): g.uuid for g in snap.gpus if g.parent is None}
    local = snap.host_to_local
    on_device: dict[str, list[int]] = {}
    for gp in snap.gpu_processes:
        on_device.setdefault(gp.gpu_uuid, []).append(local.get(gp.pid, gp.pid))
    # A pod replaced under the same name (a StatefulSet's) has two folders until the kubelet
    # removes the old one: the name then gives several UIDs.
    by_name: dict[tuple[str, str], set[str]] = {}
    for p in (pods or {}).values():
        by_name.setdefault((p.namespace, p.name), set()).add(p.uid)

    def uids_on(uuid: str) -> str | None:
        return _agreed(identities.get(pid, {}).get(POD_UID) for pid in on_device.get(uuid, ()))

    def uid_named(namespace: str, pod: str, uuid: str) -> str | None:
        """The UID of the pod the kubelet names as holding ``uuid``: the logs' one, else (a
        replaced pod) the one of those whose processes use the device."""
        found = by_name.get((namespace, pod), set())
        if len(found) == 1:
            return next(iter(found))
        on = uids_on(uuid)
        return on if on in found else None

    # Device -> the one container holding it (a GPU shared by several containers: none).
    holders: dict[str, set[tuple[str, str, str]]] = {}
    for a in allocations or ():
        holders.setdefault(device_uuid(a.device_id, by_index), set()).add(
            (a.namespace, a.pod, a.container)
        )
    owners: dict[str, PodRef] = {}
    for uuid, held_by in holders.items():
        if len(held_by) == 1:
            namespace, pod, container = next(iter(held_by))
            # The pod logs name the UID; without them, the processes on the device do.
            uid = uid_named(namespace, pod, uuid) if pods else uids_on(uuid)
            owners[uuid] = PodRef(namespace, pod, container, uid)
    if allocations is None:  # no kubelet: the one pod whose processes use the device
        for uuid in on_device:
            uid = uids_on(uuid)
            if uid is not None:
                owners[uuid] = PodRef(uid=uid)

    pod_names = {uid: (p.namespace, p.name) for uid, p in (pods or {}).items()}
    container_names: dict[str, str] = {}  # container.id -> name, learnt from allocations
    for uuid, owner in owners.items():
        if owner.uid is None:
            continue
        if owner.name and owner.namespace:
            pod_names.setdefault(owner.uid, (owner.namespace, owner.name))
        for pid in on_device.get(uuid, ()):
            identity = identities.get(pid, {})
            cid = identity.get(CONTAINER_ID)
            if owner.container and cid and identity.get(POD_UID) == owner.uid:
                container_names.setdefault(cid, owner.container)

    def pod_of(uid: str, cid: str | None) -> PodRef:
        namespace, name = pod_names.get(uid, (None, None))
        container = container_names.get(cid) if cid else None
        if container is None and pods and uid in pods and len(pods[uid].containers) == 1:
            container = pods[uid].containers[0]
        return PodRef(namespace, name, container, uid)

    gpu_labels: dict[str, Extra] = {}
    for uuid, owner in owners.items():
        if owner.uid is not None and owner.name is None:  # cgroup mode: names from the logs
            cid = _agreed(identities.get(pid, {}).get(CONTAINER_ID) for pid in on_device[uuid])
            owner = pod_of(owner.uid, cid)
        gpu_labels[uuid] = owner.attributes()
    started = {p.pid: p.start_ticks for p in snap.processes}
    process_labels: dict[tuple[int, int | None], Extra] = {}
    for pid, identity in identities.items():
        uid = identity.get(POD_UID)
        if uid is not None:
            cid = identity.get(CONTAINER_ID)
            tail = ((CONTAINER_ID, cid),) if cid else ()
            process_labels[(pid, started.get(pid))] = pod_of(uid, cid).attributes() + tail

    return NodeMap(
        SeriesLabels(gpu_labels, process_labels),
        _allocated(snap, allocations, holders, owners, uid_named, identities, on_device),
        _orphaned(snap, allocations, holders, identities, pods),
    )


def _agreed(values: Iterable[str | None]) -> str | None:
    """The one value all known ones agree on; None when none is known or they differ."""
    found = {v for v in values if v}
    return next(iter(found)) if len(found) == 1 else None


def _allocated(
    snap: Snapshot,
    allocations: list[Allocation] | None,
    holders: Mapping[str, set[tuple[str, str, str]]],
    owners: Mapping[str, PodRef],
    uid_named: Callable[[str, str, str], str | None],
    identities: Mapping[int, Identity],
    on_device: Mapping[str, list[int]],
) -> list[Row]:
    used = {gp.gpu_uuid for gp in snap.gpu_processes}
    rows: list[Row] = []
    if allocations is not None:
        by_index = {str(g.index): g.uuid for g in snap.gpus if g.parent is None}
        for a in allocations:
            uuid = device_uuid(a.device_id, by_index)
            attrs: dict[str, Any] = {
                "hw.id": uuid,
                "k8s.pod.name": a.pod,
                "k8s.namespace.name": a.namespace,
                "k8s.container.name": a.container,
                GPU_IN_USE: uuid in used,
            }
            uid = uid_named(a.namespace, a.pod, uuid) or (
                owners[uuid].uid if len(holders[uuid]) == 1 else None
            )
            if uid:
                attrs[POD_UID] = uid
            rows.append((1.0, attrs))
        return rows
    # Without the kubelet, only the devices in use are known: one row per device and pod.
    seen: set[tuple[str, str]] = set()
    for uuid, pids in on_device.items():
        for pid in pids:
            identity = identities.get(pid, {})
            uid = identity.get(POD_UID)
            if uid is None or (uuid, uid) in seen:
                continue
            seen.add((uuid, uid))
            rows.append((1.0, {"hw.id": uuid, **identity, GPU_IN_USE: True}))
    return rows


def _orphaned(
    snap: Snapshot,
    allocations: list[Allocation] | None,
    holders: Mapping[str, set[tuple[str, str, str]]],
    identities: Mapping[int, Identity],
    pods: Mapping[str, PodDir] | None,
) -> list[Row]:
    """Memory of processes whose pod is gone (any GPU) or on a GPU no pod holds."""
    parents = {g.uuid: g.parent for g in snap.gpus if g.parent is not None}
    held = set(holders)
    # A GPU whose MIG devices are allocated is held too (its lists aggregate theirs).
    held |= {parents[u] for u in held if u in parents}
    # A MIG parent lists its devices' processes again: count each on its MIG device only.
    on_mig = {(parents[gp.gpu_uuid], gp.pid) for gp in snap.gpu_processes if gp.gpu_uuid in parents}
    live = set(pods) if pods else None  # an empty or unreadable folder says nothing
    rows: list[Row] = []
    for gp in snap.gpu_processes:
        if not gp.used_memory or (gp.gpu_uuid, gp.pid) in on_mig:
            continue
        uid = identities.get(snap.host_to_local.get(gp.pid, gp.pid), {}).get(POD_UID)
        attrs: dict[str, Any] = {"hw.id": gp.gpu_uuid, "process.pid": gp.pid}
        if uid is not None and live is not None and uid not in live:
            attrs[ORPHAN_REASON] = POD_GONE
            attrs[POD_UID] = uid
        elif allocations is not None and gp.gpu_uuid not in held:
            attrs[ORPHAN_REASON] = NO_POD
        else:
            continue
        rows.append((float(gp.used_memory), attrs))
    return rows
