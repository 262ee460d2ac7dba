"""The pods a node runs, as its ``/var/log/pods`` directories name them.

The kubelet keeps one directory per pod, ``<namespace>_<pod name>_<pod UID>``, holding one
directory per container (``<container name>/<restart>.log``), and removes it when the pod is
deleted: the mapping log collectors (promtail, fluent-bit) read to name a pod from its UID.
Namespaces, pod names and container names cannot contain ``_`` (DNS names), so the split is
exact. Reading never raises; an unreadable folder gives None ("not known"), not "no pods".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_POD_LOGS = "/var/log/pods"


@dataclass(frozen=True, slots=True)
class PodDir:
    """One pod of the node: its names and its containers' names (sorted)."""

    namespace: str
    name: str
    uid: str
    containers: tuple[str, ...] = ()


def parse_pod_dir(entry: str) -> tuple[str, str, str] | None:
    """``(namespace, name, uid)`` from a directory name; None for anything else."""
    parts = entry.split("_")
    if len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[1], parts[2]


def read_pod_logs(root: str) -> dict[str, PodDir] | None:
    """The node's pods by UID; None when ``root`` cannot be listed (not mounted)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return None
    pods: dict[str, PodDir] = {}
    for entry in entries:
        parsed = parse_pod_dir(entry)
        if parsed is None:
            continue
        try:
            containers = tuple(sorted(os.listdir(os.path.join(root, entry))))
        except OSError:  # removed while listing, or not a directory
            continue
        namespace, name, uid = parsed
        pods[uid] = PodDir(namespace, name, uid, containers)
    return pods
