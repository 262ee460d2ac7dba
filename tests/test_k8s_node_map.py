"""The pure GPU/process -> pod pairing (otel_gpu/k8s/node_map.py) and the /var/log/pods reader,
driven by tables: the cases the end-to-end tests (test_k8s_series.py) do not build; the
attribution's cgroup cache under PID reuse."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from otel_gpu.agent.instruments import process_attrs
from otel_gpu.agent.labels import collecting
from otel_gpu.k8s.attribution import NodeAttribution
from otel_gpu.k8s.node_map import map_node
from otel_gpu.k8s.podlogs import PodDir, parse_pod_dir, read_pod_logs
from otel_gpu.k8s.podresources import Allocation
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

GPU_A, GPU_B = (
    "GPU-aaaaaaaa-0000-4000-8000-000000000000",
    "GPU-bbbbbbbb-0000-4000-8000-000000000000",
)
UID_1, UID_2 = "11111111-2222-4333-8444-555555555555", "66666666-7777-4888-9999-000000000000"
UID_3 = "33333333-4444-4555-8666-777777777777"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("entry", "parsed"),
    [
        (f"serving_vllm-0_{UID_1}", ("serving", "vllm-0", UID_1)),
        ("kube-system_kube-proxy-x7k2p_0c9d1b6e5f3a4c2b8e7d6f5a4b3c2d1e", ("kube-system", "kube-proxy-x7k2p", "0c9d1b6e5f3a4c2b8e7d6f5a4b3c2d1e")),  # a static pod's hash
        ("serving_vllm-0", None),  # no UID
        (f"a_b_c_{UID_1}", None),  # names never hold "_"
        (f"_vllm-0_{UID_1}", None),
        ("lost+found", None),
    ],
)  # fmt: skip
def test_pod_log_folder_names(entry: str, parsed: tuple[str, str, str] | None) -> None:
    assert parse_pod_dir(entry) == parsed


@pytest.mark.unit
def test_pod_logs_list_pods_and_their_containers(tmp_path: Path) -> None:
    for folder in (f"serving_vllm-0_{UID_1}/vllm", f"serving_vllm-0_{UID_1}/otel-gpu", "junk"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / f"batch_job-1_{UID_2}").write_text("")  # not a folder: skipped
    assert read_pod_logs(str(tmp_path)) == {
        UID_1: PodDir("serving", "vllm-0", UID_1, ("otel-gpu", "vllm"))
    }
    assert read_pod_logs(str(tmp_path / "absent")) is None  # unknown, not "no pods"


def _alloc(device: str, pod: str, container: str = "main") -> Allocation:
    return Allocation(device, "nvidia.com/gpu", pod, "ns", container)


SNAP = Snapshot(
    time=0.0,
    gpus=(GpuSample(uuid=GPU_A, index=0), GpuSample(uuid=GPU_B, index=1)),
    gpu_processes=(GpuProcessSample(10, GPU_A, 1 << 30), GpuProcessSample(20, GPU_B, 1 << 30)),
)
IDS = {10: {"k8s.pod.uid": UID_1}, 20: {"k8s.pod.uid": UID_2}}
PODS = {UID_1: PodDir("ns", "a", UID_1, ("main",)), UID_2: PodDir("ns", "b", UID_2, ("main",))}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("allocations", "pods", "gpu_a", "pid_10"),
    [
        # Time-slicing: one GPU shared by two pods as <uuid>::<replica>: no one pod's GPU.
        ([_alloc(f"{GPU_A}::0", "a"), _alloc(f"{GPU_A}::1", "b")], PODS, {},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"}),
        # One replica of a shared GPU: still the UUID, the one pod's.
        ([_alloc(f"{GPU_A}::3", "a")], PODS,
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"}),
        # No pod logs: the UID comes from the device's processes, the names from the kubelet.
        ([_alloc("0", "a")], None,
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1}),
        # A pod the logs do not list yet: its names, no UID; the process keeps only its own UID.
        ([_alloc(GPU_A, "c")], PODS,
         {"k8s.namespace.name": "ns", "k8s.pod.name": "c", "k8s.container.name": "main"},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"}),
        # Pod "a" replaced under the same name, the old one's folder not yet removed: the UID
        # is the one whose processes use the GPU, whichever folder is listed first.
        ([_alloc(GPU_A, "a")], {UID_1: PODS[UID_1], UID_3: PodDir("ns", "a", UID_3, ("main",))},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"}),
        ([_alloc(GPU_A, "a")], {UID_3: PodDir("ns", "a", UID_3, ("main",)), UID_1: PODS[UID_1]},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"},
         {"k8s.namespace.name": "ns", "k8s.pod.name": "a", "k8s.pod.uid": UID_1, "k8s.container.name": "main"}),
    ],
)  # fmt: skip
def test_pairing(
    allocations: list[Allocation],
    pods: dict[str, PodDir] | None,
    gpu_a: dict[str, str],
    pid_10: dict[str, str],
) -> None:
    found = map_node(SNAP, allocations, IDS, pods)
    assert dict(found.labels.gpu.get(GPU_A, ())) == gpu_a
    assert dict(found.labels.process.get((10, None), ())) == pid_10  # on a GPU only: no start


@pytest.mark.unit
def test_an_empty_pod_log_folder_calls_no_process_gone() -> None:
    """A folder that lists no pod (mounted from the wrong path) must not make every process an
    orphan: the DaemonSet's own pod is always there on a real node."""
    assert map_node(SNAP, [_alloc(GPU_A, "a"), _alloc(GPU_B, "b")], IDS, {}).orphaned == []
    gone = map_node(SNAP, [_alloc(GPU_A, "a"), _alloc(GPU_B, "b")], IDS, {UID_1: PODS[UID_1]})
    assert [(a["process.pid"], a["otel_gpu.orphan.reason"]) for _, a in gone.orphaned] == [
        (20, "pod_gone")
    ]


@pytest.mark.unit
@pytest.mark.parametrize("old_first", [True, False])
def test_a_replaced_pods_allocation_row_names_the_running_pods_uid(old_first: bool) -> None:
    old, new = PodDir("ns", "a", UID_3, ("main",)), PODS[UID_1]
    pods = {UID_3: old, UID_1: new} if old_first else {UID_1: new, UID_3: old}
    found = map_node(SNAP, [_alloc(GPU_A, "a")], IDS, pods)
    assert [a["k8s.pod.uid"] for _, a in found.allocated] == [UID_1]


def _cgroup_of(uid: str) -> str:
    return f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{'c' * 64}.scope\n"


@pytest.mark.process
@pytest.mark.parametrize(
    ("before", "after"),
    [
        # In the watched tree: a new start time is a new process, read again.
        (ProcessSample(10, start_ticks=100), ProcessSample(10, start_ticks=900)),
        # On a GPU only (no start time known): read at every refresh, never trusted from before.
        (None, None),
    ],
)
def test_a_reused_pid_is_attributed_to_its_new_pod(
    tmp_path: Path, before: ProcessSample | None, after: ProcessSample | None
) -> None:
    (tmp_path / "10").mkdir()
    snap = Snapshot(time=0.0, gpus=SNAP.gpus, gpu_processes=(GpuProcessSample(10, GPU_A, 1),))
    node = NodeAttribution(lambda: snap, str(tmp_path / "no-kubelet.sock"), proc_root=str(tmp_path))
    for uid, process in ((UID_1, before), (UID_2, after)):
        (tmp_path / "10" / "cgroup").write_text(_cgroup_of(uid))
        snap = replace(snap, processes=(process,) if process else ())
        assert node.refresh()
        key = (10, process.start_ticks if process else None)
        assert dict(node.series_labels().process[key])["k8s.pod.uid"] == uid


@pytest.mark.unit
def test_a_pid_reused_before_the_next_refresh_carries_no_old_pod() -> None:
    """The labels name a process by PID and start time: until the attribution thread reads the
    new process, a reused PID gets no k8s.* at all, never the previous process's pod."""
    snap = replace(SNAP, processes=(ProcessSample(10, start_ticks=100),))
    labels = map_node(snap, None, IDS, PODS).labels
    token = collecting.set(labels)
    try:
        old = process_attrs(ProcessSample(10, start_ticks=100))
        reused = process_attrs(ProcessSample(10, start_ticks=900))
    finally:
        collecting.reset(token)
    assert old["k8s.pod.uid"] == UID_1 and old["k8s.pod.name"] == "a"
    assert not any(key.startswith("k8s.") for key in reused)
