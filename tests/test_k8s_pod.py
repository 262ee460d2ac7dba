"""Pod attribution without the kubelet: the downward API, else the watched process's cgroup; and
the GPUs the pod was given, read from the server's environment (a fake /proc folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_gpu.k8s.pod import (
    KubernetesResourceDetector,
    from_cgroup,
    pod_identity,
    pod_visible_devices,
    watched_pod_pids,
)

pytestmark = pytest.mark.unit

UID = "3f6b1c2e-8a4d-4e5f-9a0b-1c2d3e4f5a6b"
CID = "a" * 56 + "0123abcd"

CGROUPS = [
    ("v1, cgroupfs driver, containerd",
     f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n",
     {"k8s.pod.uid": UID, "container.id": CID}),
    ("v2, systemd driver, containerd",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
     {"k8s.pod.uid": UID, "container.id": CID}),
    ("v2, systemd driver, CRI-O, guaranteed QoS",
     f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
     {"k8s.pod.uid": UID, "container.id": CID}),
    ("the pod's own cgroup (the pause level)", f"0::/kubepods/besteffort/pod{UID}\n", {"k8s.pod.uid": UID}),
    ("a cgroup namespace hides the path", "0::/\n", {}),
    ("Docker outside Kubernetes", f"0::/system.slice/docker-{CID}.scope\n", {}),
    ("not a cgroup file", "garbage", {}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "expected"), CGROUPS, ids=[c[0] for c in CGROUPS])
def test_cgroup_paths_name_the_pod_and_container(name: str, text: str, expected: dict) -> None:
    assert from_cgroup(text).as_dict() == expected


def _proc(
    tmp_path: Path, pid: int, *, cgroup: str = "", environ: dict[str, str] | None = None
) -> None:
    d = tmp_path / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(
        b"".join(f"{k}={v}".encode() + b"\0" for k, v in (environ or {}).items())
    )


DOWNWARD = {
    "K8S_POD_NAME": "vllm-7d9f-x2k4",
    "K8S_NAMESPACE_NAME": "serving",
    "K8S_POD_UID": UID,
    "K8S_CONTAINER_NAME": "vllm",
}


def test_the_downward_api_wins_and_the_cgroup_fills_in(tmp_path: Path) -> None:
    _proc(tmp_path, 1, cgroup="0::/\n")  # pause: nothing to learn
    _proc(tmp_path, 42, cgroup=f"0::/kubepods/burstable/pod{UID}/{CID}\n")
    got = pod_identity(DOWNWARD, [1, 42], str(tmp_path)).as_dict()
    assert got == {
        "k8s.pod.name": "vllm-7d9f-x2k4",
        "k8s.namespace.name": "serving",
        "k8s.pod.uid": UID,
        "k8s.container.name": "vllm",
        "container.id": CID,
    }
    only_cgroup = KubernetesResourceDetector([1, 42], {}, str(tmp_path)).detect()
    assert dict(only_cgroup.attributes) == {"k8s.pod.uid": UID, "container.id": CID}
    outside = KubernetesResourceDetector([7], {}, str(tmp_path)).detect()  # no such process
    assert dict(outside.attributes) == {}


MIG = "MIG-5d3c0000-1111-4000-8000-000000000001"
DEVICES = [
    ("the server's device-plugin list", {}, {"NVIDIA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, "GPU-aa,GPU-bb"),
    ("a MIG device", {}, {"NVIDIA_VISIBLE_DEVICES": MIG}, MIG),
    ("the server's CUDA list without the plugin's", {}, {"CUDA_VISIBLE_DEVICES": "1"}, "1"),
    ("the sidecar's own CUDA list wins", {"CUDA_VISIBLE_DEVICES": "0"}, {"NVIDIA_VISIBLE_DEVICES": "GPU-aa"}, "0"),
    ("the DaemonSet's all", {"CUDA_VISIBLE_DEVICES": "all"}, {"NVIDIA_VISIBLE_DEVICES": "GPU-aa"}, None),
    ("void: no GPU", {}, {"NVIDIA_VISIBLE_DEVICES": "void"}, ""),
    ("nothing set: every GPU", {}, {}, None),
    ("the sidecar's plugin list when the server has none", {"NVIDIA_VISIBLE_DEVICES": "GPU-cc"}, {}, "GPU-cc"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "own", "server", "expected"), DEVICES, ids=[d[0] for d in DEVICES]
)
def test_the_pods_gpus_come_from_the_servers_environment(
    tmp_path: Path, name: str, own: dict, server: dict, expected: str | None
) -> None:
    _proc(tmp_path, 1)
    _proc(tmp_path, 42, environ={"PATH": "/usr/bin", **server})
    assert pod_visible_devices(own, [1, 42, 99], str(tmp_path)) == expected


def _stat(tmp_path: Path, pid: int, comm: str, ppid: int) -> None:
    d = tmp_path / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", str(ppid)] + ["0"] * 49
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")


@pytest.mark.parametrize(
    ("host", "matched", "expected"),
    [
        (False, False, [7, 42]),  # a pod: everyone but the pause process
        (False, True, [42]),  # --match: the matched processes
        (True, False, []),  # hostPID (the DaemonSet): the node's processes are many pods'
    ],
)
def test_which_processes_speak_for_the_pod(
    tmp_path: Path, host: bool, matched: bool, expected: list[int]
) -> None:
    _stat(tmp_path, 1, "pause", 0)
    _stat(tmp_path, 7, "sh", 1)
    _stat(tmp_path, 42, "vllm", 1)
    if host:
        _stat(tmp_path, 2, "kthreadd", 0)
    got = watched_pod_pids([42] if matched else [1], matched, str(tmp_path))
    assert got == expected
