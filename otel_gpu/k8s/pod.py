"""Which Kubernetes pod the watched processes run in: the downward API, else their cgroup.

The sidecar's resource carries the pod's semconv attributes (``k8s.pod.name``,
``k8s.pod.uid``, ``k8s.namespace.name``, ``k8s.container.name``, ``container.id``), from:

1. the downward API, as environment variables the manifest sets (``K8S_POD_NAME``,
   ``K8S_POD_UID``, ``K8S_NAMESPACE_NAME``, ``K8S_CONTAINER_NAME``; see deploy/kubernetes);
2. else a watched process's cgroup path, which the kubelet names after the pod UID and the
   container runtime after the container ID (cgroup v1 and v2, cgroupfs and systemd drivers,
   containerd, CRI-O and Docker). Pod name and namespace are not in the cgroup.

Reading never raises: a missing or unreadable file gives no attributes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource, ResourceDetector

from otel_gpu.sampling.procfs import read_stat

log = logging.getLogger("otel_gpu.k8s")

POD_ROOT_PID = 1  # the pause process, parent of every container's processes in a shared namespace

DOWNWARD_ENV = {
    "k8s.pod.name": "K8S_POD_NAME",
    "k8s.pod.uid": "K8S_POD_UID",
    "k8s.namespace.name": "K8S_NAMESPACE_NAME",
    "k8s.container.name": "K8S_CONTAINER_NAME",
}

# pod<uid>, with dashes (cgroupfs driver) or underscores (systemd driver: kubepods-pod<uid>.slice)
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)
# The last path element: <id>, cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope
_CONTAINER_ID = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True, slots=True)
class PodIdentity:
    """The attributes known about one pod (and container); empty when none is."""

    attributes: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, str]:
        return dict(self.attributes)


def from_downward_api(env: Mapping[str, str]) -> PodIdentity:
    """The pod as the manifest's downward-API environment variables name it."""
    found = [
        (key, env[var].strip()) for key, var in DOWNWARD_ENV.items() if env.get(var, "").strip()
    ]
    return PodIdentity(tuple(found))


def from_cgroup(text: str) -> PodIdentity:
    """Pod UID and container ID from the text of a ``/proc/PID/cgroup`` file."""
    uid = container = None
    for line in text.splitlines():
        path = line.split(":", 2)[-1].strip()
        match = _POD_UID.search(path)
        if match is None:
            continue
        uid = uid or match.group(1).replace("_", "-")
        tail = _CONTAINER_ID.search(path)
        if tail is not None:
            container = container or tail.group(1)
    found = []
    if uid is not None:
        found.append(("k8s.pod.uid", uid))
    if container is not None:
        found.append(("container.id", container))
    return PodIdentity(tuple(found))


def read_cgroup(pid: int, proc_root: str = "/proc") -> PodIdentity:
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup"), encoding="utf-8") as f:
            return from_cgroup(f.read(65536))
    except OSError:
        return PodIdentity()


def pod_identity(
    env: Mapping[str, str], pids: Iterable[int], proc_root: str = "/proc"
) -> PodIdentity:
    """Downward API first; the cgroup of the first of ``pids`` that names a pod fills the rest."""
    merged = from_downward_api(env).as_dict()
    for pid in pids:
        found = read_cgroup(pid, proc_root).as_dict()
        if found:
            for key, value in found.items():
                merged.setdefault(key, value)
            break
    return PodIdentity(tuple(merged.items()))


class KubernetesResourceDetector(ResourceDetector):
    """The pod's attributes on the resource (empty outside Kubernetes; never raises)."""

    def __init__(
        self,
        pids: Iterable[int] = (),
        env: Mapping[str, str] | None = None,
        proc_root: str = "/proc",
    ) -> None:
        super().__init__()
        self._pids = list(pids)
        self._env = os.environ if env is None else env
        self._proc_root = proc_root

    def detect(self) -> Resource:
        try:
            return Resource(pod_identity(self._env, self._pids, self._proc_root).as_dict())
        except Exception as exc:  # a detector must never stop the agent
            log.debug("no Kubernetes attributes: %s", exc)
            return Resource.get_empty()


def pod_visible_devices(
    own_env: Mapping[str, str], pids: Iterable[int], proc_root: str = "/proc"
) -> str | None:
    """The GPUs the pod was given, in ``CUDA_VISIBLE_DEVICES`` syntax (None: every GPU).

    The sidecar's own ``CUDA_VISIBLE_DEVICES`` wins (``all``: every GPU, as the node-wide
    DaemonSet sets it). Else a watched process's ``NVIDIA_VISIBLE_DEVICES``, which the device
    plugin sets on the container that asked for GPUs (UUIDs, MIG UUIDs or indices), then its
    ``CUDA_VISIBLE_DEVICES``; else the sidecar's own ``NVIDIA_VISIBLE_DEVICES``. ``all`` means
    every GPU; ``void`` and ``none`` none.
    """
    if "CUDA_VISIBLE_DEVICES" in own_env:
        return _device_list(own_env["CUDA_VISIBLE_DEVICES"])
    for pid in pids:
        environ = _read_environ(pid, proc_root)
        for var in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            if var in environ:
                return _device_list(environ[var])
    if "NVIDIA_VISIBLE_DEVICES" in own_env:
        return _device_list(own_env["NVIDIA_VISIBLE_DEVICES"])
    return None


def _device_list(value: str) -> str | None:
    text = value.strip()
    if text.lower() == "all":
        return None
    if text.lower() in ("void", "none"):
        return ""
    return text


def _read_environ(pid: int, proc_root: str) -> dict[str, str]:
    try:
        with open(os.path.join(proc_root, str(pid), "environ"), "rb") as f:
            raw = f.read(1 << 20)
    except OSError:  # another user's process, or gone
        return {}
    out = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def watched_pod_pids(roots: list[int], matched: bool, proc_root: str = "/proc") -> list[int]:
    """The processes whose cgroup and environment say which pod and GPUs are watched: the
    matched ones; else every process of the pod but the pause process (its cgroup is its own
    container's); none when the node's PIDs are visible (hostPID: they belong to many pods)."""
    if matched:
        return roots
    if sees_host_pids(proc_root):
        return []
    return [pid for pid in visible_pids(proc_root) if pid != POD_ROOT_PID]


def sees_host_pids(proc_root: str) -> bool:
    """Kernel threads (kthreadd is PID 2, parent 0) exist only in the host's PID namespace."""
    st = read_stat(proc_root, 2)
    return st is not None and st.ppid == 0 and st.comm == "kthreadd"


def visible_pids(proc_root: str) -> list[int]:
    """Every PID in ``proc_root`` but this process's own."""
    own = os.getpid()
    try:
        return sorted(int(n) for n in os.listdir(proc_root) if n.isdigit() and int(n) != own)
    except OSError:
        return []
