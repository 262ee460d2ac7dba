"""The DaemonSet's per-GPU and per-process series carry their pod's ``k8s.*``: a real gRPC kubelet
(the vendored proto) on a unix socket allocating GPUs, a MIG device and an idle GPU to pods, the
C fake NVML listing real child processes on them, a fake /proc tree holding their cgroups and a
fake /var/log/pods, all read through the agent's real instruments and the OTel SDK reader."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.cli import clean_env
from support.kubelet import PodSpec, compiled_stubs, kubelet
from support.otlp_sink import OtlpSink, Point
from support.paths import ROOT
from support.sdk_metrics import collect
from support.waits import wait_until

from otel_gpu.agent.agent import Agent
from otel_gpu.agent.settings import Settings
from otel_gpu.k8s.attribution import SOURCE_CGROUP, SOURCE_PODRESOURCES, NodeAttribution

GPU_A, GPU_B, GPU_C, GPU_D = (f"GPU-a000000{i}-0000-4000-8000-000000000000" for i in range(4))
MIG_B = "MIG-b0000000-1111-4000-8000-000000000001"
UID = {  # pod UIDs: the node's pods, one deleted pod, one that replaces vllm-0
    name: f"{i:08x}-1111-4222-8333-{i:012x}"
    for i, name in enumerate(("vllm-0", "sglang-0", "idle-0", "gone", "vllm-1"), start=1)
}
GIB = 1 << 30
K8S = ("k8s.namespace.name", "k8s.pod.name", "k8s.pod.uid", "k8s.container.name")


def _cgroup(uid: str, container_id: str) -> str:
    """A cgroup v2 path as the kubelet's systemd driver and containerd name it."""
    pod = uid.replace("-", "_")
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod}.slice/"
        f"cri-containerd-{container_id}.scope\n"
    )


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ModuleType, ModuleType]]:
    yield from compiled_stubs(tmp_path_factory)


class Node:
    """One GPU node: its processes, kubelet, pod logs and the agent with its attribution."""

    ROLES = ("vllm", "gone", "sglang", "host", "vllm1")

    def __init__(
        self, fake: FakeNvml, tmp_path: Path, stubs: tuple[ModuleType, ModuleType], kubelet_up: bool
    ) -> None:
        self.children = {
            role: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            for role in self.ROLES
        }
        self.pid = {role: p.pid for role, p in self.children.items()}
        self.cid = {role: f"{i:x}" * 64 for i, role in enumerate(self.ROLES, start=10)}
        self.proc = tmp_path / "proc"
        cgroups = {
            "vllm": _cgroup(UID["vllm-0"], self.cid["vllm"]),
            "gone": _cgroup(UID["gone"], self.cid["gone"]),  # outlived its pod
            "sglang": _cgroup(UID["sglang-0"], self.cid["sglang"]),
            "host": "0::/system.slice/nvidia-persistenced.service\n",  # not in a pod
            "vllm1": _cgroup(UID["vllm-1"], self.cid["vllm1"]),
        }
        for role, text in cgroups.items():
            (self.proc / str(self.pid[role])).mkdir(parents=True)
            (self.proc / str(self.pid[role]) / "cgroup").write_text(text)
        self.logs = tmp_path / "pods"
        for pod, namespace, containers in (
            ("vllm-0", "serving", ("vllm", "otel-gpu")),
            ("sglang-0", "serving", ("sglang",)),
            ("idle-0", "batch", ("trainer",)),
        ):
            self.add_pod_logs(pod, namespace, containers)
        self.pods: list[PodSpec] = [
            ("vllm-0", "serving", [("vllm", "nvidia.com/gpu", (GPU_A,)), ("otel-gpu", "", ())]),
            ("sglang-0", "serving", [("sglang", "nvidia.com/mig-3g.40gb", (MIG_B,))]),
            ("idle-0", "batch", [("trainer", "nvidia.com/gpu", ("2",))]),  # the index strategy
        ]
        socket = tmp_path / "kubelet.sock"
        self.server = kubelet(stubs, socket, self.pods) if kubelet_up else None
        self.fake = fake
        self.on_gpu0 = f"{self.pid['vllm']}:{20 * GIB} {self.pid['gone']}:{GIB}"
        self.write_scenario()
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.attribution = NodeAttribution(
            lambda: self.agent.sampler.latest,
            str(socket),
            proc_root=str(self.proc),
            pod_logs=str(self.logs),
            timeout_s=0.5,
        )
        self.agent = Agent(
            Settings(interval_s=1.0, detect=False),
            meter_provider=self.provider,
            roots=list(self.pid.values()),
            source=fake.source(),
            series_labels=self.attribution.series_labels,
        )
        self.attribution.register_instruments(self.provider.get_meter("otel_gpu"))

    def add_pod_logs(self, pod: str, namespace: str, containers: tuple[str, ...]) -> None:
        for container in containers:
            folder = self.logs / f"{namespace}_{pod}_{UID[pod]}" / container
            folder.mkdir(parents=True)
            (folder / "0.log").write_text("")

    def write_scenario(self) -> None:
        self.fake.write(f"""
            devices = 4
            gpu.*.memory.total = {80 * GIB}
            gpu.*.util.gpu = 50
            gpu.0.uuid = {GPU_A}
            gpu.1.uuid = {GPU_B}
            gpu.2.uuid = {GPU_C}
            gpu.3.uuid = {GPU_D}
            gpu.1.mig = 1
            mig.1.0.uuid = {MIG_B}
            mig.1.0.memory.total = {40 * GIB}
            gpu.0.processes = {self.on_gpu0}
            mig.1.0.processes = {self.pid["sglang"]}:{8 * GIB}
            gpu.3.processes = {self.pid["host"]}:{3 * GIB}
        """)

    def sweep(self) -> dict[str, list[tuple[float, dict[str, Any], str]]]:
        """A sampler sweep, an attribution refresh, a collection (the threads' order)."""
        self.agent.sampler.sample_once()
        self.attribution.refresh()
        return collect(self.reader)

    def close(self) -> None:
        self.attribution.stop()
        self.provider.shutdown()
        if self.server is not None:
            self.server.stop(None)
        for child in self.children.values():
            child.kill()
            child.wait()


@pytest.fixture()
def node(
    fake_nvml: FakeNvml, tmp_path: Path, stubs: tuple[ModuleType, ModuleType]
) -> Iterator[Node]:
    n = Node(fake_nvml, tmp_path, stubs, kubelet_up=True)
    yield n
    n.close()


def _k8s(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if k.startswith("k8s.") or k == "container.id"}


def _by_gpu(points: list[tuple[float, dict[str, Any], str]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for _, attrs, _ in points:
        out.setdefault(attrs["hw.id"], []).append(_k8s(attrs))
    return out


def _by_pid(points: list[tuple[float, dict[str, Any], str]]) -> dict[int, dict[str, Any]]:
    return {attrs["process.pid"]: _k8s(attrs) for _, attrs, _ in points}


def _pod(namespace: str, pod: str, container: str) -> dict[str, str]:
    return dict(zip(K8S, (namespace, pod, UID[pod], container), strict=True))


@pytest.mark.peers
def test_gpu_and_process_series_carry_their_pods_attributes(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_gpu.k8s"):
        node.sweep()
        got = node.sweep()
    assert node.attribution.source == SOURCE_PODRESOURCES
    expected_gpus = {
        GPU_A: _pod("serving", "vllm-0", "vllm"),
        MIG_B: _pod("serving", "sglang-0", "sglang"),
        GPU_C: _pod("batch", "idle-0", "trainer"),  # allocated by index, idle: UID from logs
        GPU_B: {},  # the MIG device's parent: shared hardware, no one pod's
        GPU_D: {},  # allocated to no pod
    }
    for name in ("hw.gpu.memory.limit", "hw.gpu.memory.usage", "hw.status", "hw.gpu.utilization"):
        by_gpu = _by_gpu(got[name])
        assert set(by_gpu) <= set(expected_gpus) and GPU_A in by_gpu, name
        if name != "hw.gpu.utilization":  # NVML has no utilization for a MIG device
            assert set(by_gpu) == set(expected_gpus), name
        for uuid, points in by_gpu.items():
            assert all(a == expected_gpus[uuid] for a in points), (name, uuid, points)

    pid, cid = node.pid, node.cid
    expected_procs = {
        pid["vllm"]: {**_pod("serving", "vllm-0", "vllm"), "container.id": cid["vllm"]},
        pid["sglang"]: {**_pod("serving", "sglang-0", "sglang"), "container.id": cid["sglang"]},
        # A deleted pod: its UID (cgroup) but no name anywhere on the node.
        pid["gone"]: {"k8s.pod.uid": UID["gone"], "container.id": cid["gone"]},
        pid["host"]: {},
    }
    gpu_memory = {
        (a["process.pid"], a["hw.id"]): _k8s(a) for _, a, _ in got["process.gpu.memory.usage"]
    }
    assert gpu_memory == {
        (pid["vllm"], GPU_A): expected_procs[pid["vllm"]],
        (pid["gone"], GPU_A): expected_procs[pid["gone"]],
        (pid["sglang"], MIG_B): expected_procs[pid["sglang"]],
        (pid["host"], GPU_D): {},
    }
    rss = _by_pid(got["process.memory.usage"])
    assert {p: rss[p] for p in expected_procs} == expected_procs

    orphaned = sorted(
        (a["process.pid"], a["hw.id"], a["otel_gpu.orphan.reason"], a.get("k8s.pod.uid"), v)
        for v, a, _ in got["otel_gpu.gpu.memory.orphaned"]
    )
    assert orphaned == sorted([
        (pid["gone"], GPU_A, "pod_gone", UID["gone"], GIB),  # its GPU now vllm-0's
        (pid["host"], GPU_D, "no_pod", None, 3 * GIB),
    ])  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "holds" in r.getMessage()]
    assert len(warned) == 2  # one per orphaned process, not one per refresh
    assert any(UID["gone"] in w and "no longer runs" in w for w in warned)


@pytest.mark.peers
def test_a_replaced_pod_starts_new_series(node: Node) -> None:
    node.sweep()
    # vllm-0 is deleted and vllm-1 takes its GPU: new kubelet allocation, new log folder, the
    # old server gone and the new one on the GPU (beside the deleted pod's leftover).
    node.pods[0] = ("vllm-1", "serving", [("vllm", "nvidia.com/gpu", (GPU_A,))])
    shutil.rmtree(node.logs / f"serving_vllm-0_{UID['vllm-0']}")
    node.add_pod_logs("vllm-1", "serving", ("vllm",))
    node.children["vllm"].kill()
    node.children["vllm"].wait()
    node.on_gpu0 = f"{node.pid['vllm1']}:{18 * GIB} {node.pid['gone']}:{GIB}"
    node.write_scenario()

    got = node.sweep()
    by_gpu = _by_gpu(got["hw.gpu.memory.limit"])
    assert by_gpu[GPU_A] == [_pod("serving", "vllm-1", "vllm")]  # one series, the new pod's
    gpu_memory = {a["process.pid"]: _k8s(a) for _, a, _ in got["process.gpu.memory.usage"]}
    assert node.pid["vllm"] not in gpu_memory
    assert gpu_memory[node.pid["vllm1"]] == {
        **_pod("serving", "vllm-1", "vllm"),
        "container.id": node.cid["vllm1"],
    }
    assert not [
        a for points in got.values() for _, a, _ in points if a.get("k8s.pod.name") == "vllm-0"
    ]


@pytest.mark.process
def test_without_the_kubelet_cgroups_and_pod_logs_attribute_the_series(
    fake_nvml: FakeNvml,
    tmp_path: Path,
    stubs: tuple[ModuleType, ModuleType],
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = Node(fake_nvml, tmp_path, stubs, kubelet_up=False)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_gpu.k8s"):
            node.sweep()
            got = node.sweep()
    finally:
        node.close()
    assert node.attribution.source == SOURCE_CGROUP
    assert len([r for r in caplog.records if "pod-resources socket" in r.getMessage()]) == 1
    by_gpu = _by_gpu(got["hw.gpu.memory.limit"])
    # The one pod whose processes use a device names it; GPU 0 holds two pods' processes.
    assert by_gpu[MIG_B] == [_pod("serving", "sglang-0", "sglang")]  # one container: named
    assert by_gpu[GPU_A] == by_gpu[GPU_C] == by_gpu[GPU_D] == [{}]
    rss = _by_pid(got["process.memory.usage"])
    vllm = _pod("serving", "vllm-0", "vllm")
    del vllm["k8s.container.name"]  # two containers in the pod's logs: which one is unknown
    assert rss[node.pid["vllm"]] == {**vllm, "container.id": node.cid["vllm"]}
    orphaned = [(a["process.pid"], a["otel_gpu.orphan.reason"]) for _, a, _ in got.get(
        "otel_gpu.gpu.memory.orphaned", [])]  # fmt: skip
    assert orphaned == [(node.pid["gone"], "pod_gone")]  # no_pod needs the kubelet


@pytest.mark.process
def test_the_daemonset_command_exports_labelled_series(
    fake_nvml: FakeNvml, tmp_path: Path, stubs: tuple[ModuleType, ModuleType]
) -> None:
    """``otel-gpu sidecar --pod-resources --pod-logs`` as the DaemonSet runs it, over OTLP: the
    labels reach the exported GPU series from the first refresh on."""
    job = tmp_path / "otel-k8s-job"
    job.symlink_to(shutil.which("sleep") or "/bin/sleep")  # a name --match finds only here
    child = subprocess.Popen([str(job), "120"])
    socket, logs = tmp_path / "kubelet.sock", tmp_path / "pods"
    (logs / f"serving_vllm-0_{UID['vllm-0']}" / "vllm").mkdir(parents=True)
    server = kubelet(stubs, socket, [("vllm-0", "serving", [("vllm", "nvidia.com/gpu", ("0",))])])
    fake_nvml.write(f"""
        devices = 2
        gpu.0.uuid = {GPU_A}
        gpu.1.uuid = {GPU_D}
        gpu.1.processes = {child.pid}:{GIB}
    """)
    with OtlpSink() as sink:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "otel_gpu.cli", "sidecar", "--match", job.name,
             "--pod-resources", str(socket), "--pod-logs", str(logs), "--interval", "0.5",
             "--endpoint", sink.endpoint, "--export-interval", "1", "--no-detect"],
            env=fake_nvml.env(clean_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="all")),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:

            def labelled() -> list[Point]:
                return [
                    p
                    for p in sink.points()
                    if p.metric == "hw.gpu.memory.limit" and "k8s.pod.name" in p.attributes
                ]

            first = wait_until("labelled GPU series", labelled)
            points = sink.points()
        finally:
            sidecar.terminate()
            _, stderr = sidecar.communicate(timeout=30)
            child.kill()
            child.wait()
            server.stop(None)
    assert isinstance(first, list)
    assert {p.attributes["hw.id"] for p in first} == {GPU_A}
    assert _k8s(first[-1].attributes) == _pod("serving", "vllm-0", "vllm"), stderr
    assert not [p for p in points if p.attributes.get("hw.id") == GPU_D and _k8s(p.attributes)]
    orphaned = [p for p in points if p.metric == "otel_gpu.gpu.memory.orphaned"]
    assert orphaned and orphaned[-1].attributes["otel_gpu.orphan.reason"] == "no_pod"
