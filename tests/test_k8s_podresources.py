"""GPU → pod attribution against a real gRPC PodResources server on a unix socket, speaking the
kubelet's own proto (stubs generated here by grpcio-tools from the vendored api.proto): GPUs and
MIG devices land on the right pods, idle allocations and orphaned memory are reported, and a
missing or hung socket degrades to cgroup attribution with one warning."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_tools import protoc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.kubelet import PROTO_DIR, PodSpec, compiled_stubs, kubelet

from otel_gpu.k8s.attribution import (
    SOURCE_CGROUP,
    SOURCE_PODRESOURCES,
    NodeAttribution,
    kubelet_pod_devices,
)
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, Snapshot

UID = "3f6b1c2e-8a4d-4e5f-9a0b-1c2d3e4f5a6b"
GPU_A, GPU_B, GPU_C, GPU_D = (f"GPU-0000000{i}-0000-4000-8000-000000000000" for i in range(4))
MIG_B = "MIG-5d3c0000-1111-4000-8000-000000000001"

SNAP = Snapshot(
    time=1_700_000_000.0,
    gpus=(
        GpuSample(uuid=GPU_A, index=0),
        GpuSample(uuid=GPU_B, index=1, mig_mode=True),
        GpuSample(uuid=MIG_B, index=1, parent=GPU_B),
        GpuSample(uuid=GPU_C, index=2),
        GpuSample(uuid=GPU_D, index=3),
    ),
    gpu_processes=(
        GpuProcessSample(4242, GPU_A, 20 << 30),
        GpuProcessSample(4343, MIG_B, 8 << 30),
        GpuProcessSample(4343, GPU_B, 8 << 30),  # the parent's aggregate list
        GpuProcessSample(999, GPU_D, 3 << 30),  # no pod holds GPU 3
    ),
)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ModuleType, ModuleType]]:
    yield from compiled_stubs(tmp_path_factory)


@pytest.mark.unit
def test_the_shipped_descriptor_is_the_vendored_proto_compiled(tmp_path: Path) -> None:
    out = tmp_path / "api.desc"
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{PROTO_DIR}",
                f"--descriptor_set_out={out}",
                str(PROTO_DIR / "api.proto"),
            ]
        )
        == 0
    )
    assert out.read_bytes() == (PROTO_DIR / "api.desc").read_bytes()


def _kubelet(stubs: tuple[ModuleType, ModuleType], path: Path) -> grpc.Server:
    pods: list[PodSpec] = [
        ("vllm-0", "serving", [("vllm", "nvidia.com/gpu", (GPU_A,)), ("otel-gpu", "", ())]),
        ("sglang-0", "serving", [("sglang", "nvidia.com/mig-3g.40gb", (MIG_B,))]),
        ("idle-0", "batch", [("trainer", "nvidia.com/gpu", ("2",))]),  # the index strategy
        ("nic-0", "net", [("app", "example.com/sriov", ("0000:3b:00.1",))]),  # not a GPU
    ]
    return kubelet(stubs, path, pods)


def _collect(attribution: NodeAttribution) -> dict[str, list[tuple[float, dict]]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    attribution.register_instruments(provider.get_meter("test"))
    got: dict[str, list[tuple[float, dict]]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                got[m.name] = [(p.value, dict(p.attributes)) for p in m.data.data_points]
    provider.shutdown()
    return got


@pytest.mark.process
def test_gpus_and_mig_devices_land_on_their_pods(
    stubs: tuple[ModuleType, ModuleType], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sock = tmp_path / "kubelet.sock"
    server = _kubelet(stubs, sock)
    attribution = NodeAttribution(lambda: SNAP, str(sock))
    try:
        with caplog.at_level(logging.WARNING, logger="otel_gpu.k8s"):
            attribution.refresh()
            attribution.refresh()
        got = _collect(attribution)
    finally:
        attribution.stop()
        server.stop(None)
    assert attribution.source == SOURCE_PODRESOURCES
    allocated = sorted(
        (a["hw.id"], a["k8s.namespace.name"], a["k8s.pod.name"], a["k8s.container.name"], a["otel_gpu.gpu.in_use"])
        for v, a in got["otel_gpu.gpu.allocated"] if v == 1
    )  # fmt: skip
    assert allocated == sorted([
        (GPU_A, "serving", "vllm-0", "vllm", True),
        (MIG_B, "serving", "sglang-0", "sglang", True),
        (GPU_C, "batch", "idle-0", "trainer", False),  # allocated, used by no process
    ])  # fmt: skip
    assert got["otel_gpu.gpu.memory.orphaned"] == [
        (3 << 30, {"hw.id": GPU_D, "process.pid": 999, "otel_gpu.orphan.reason": "no_pod"})
    ]
    orphan_warnings = [
        r for r in caplog.records if "no pod is allocated this GPU" in r.getMessage()
    ]
    assert len(orphan_warnings) == 1  # once per process and GPU, not every refresh


def _cgroup_proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    for pid, text in ((4242, f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{'c' * 64}.scope\n"),
                      (999, "0::/system.slice/sshd.service\n")):  # fmt: skip
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(text)
    return root


def _hung_socket(path: Path) -> socket.socket:
    """Listens but never accepts: a kubelet that hangs."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(8)
    return s


@pytest.mark.process
@pytest.mark.parametrize("broken", ["missing", "hung"])
def test_a_missing_or_hung_socket_degrades_to_cgroups_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    sock = tmp_path / "kubelet.sock"
    hung = _hung_socket(sock) if broken == "hung" else None
    attribution = NodeAttribution(
        lambda: SNAP, str(sock), proc_root=str(_cgroup_proc_root(tmp_path)), timeout_s=0.5
    )
    try:
        with caplog.at_level(logging.WARNING, logger="otel_gpu.k8s"):
            began = time.monotonic()
            attribution.refresh()
            attribution.refresh()
            elapsed = time.monotonic() - began
        got = _collect(attribution)
    finally:
        attribution.stop()
        if hung is not None:
            hung.close()
    assert attribution.source == SOURCE_CGROUP
    assert got["otel_gpu.gpu.allocated"] == [
        (
            1,
            {
                "hw.id": GPU_A,
                "k8s.pod.uid": UID,
                "container.id": "c" * 64,
                "otel_gpu.gpu.in_use": True,
            },
        )
    ]
    assert got.get("otel_gpu.gpu.memory.orphaned", []) == []  # unknowable without the kubelet
    warnings = [r.getMessage() for r in caplog.records if "pod-resources socket" in r.getMessage()]
    assert len(warnings) == 1 and "cgroups" in warnings[0]
    assert elapsed < 30  # bounded by the 0.5 s deadline per call, not hung with the kubelet


@pytest.mark.process
@pytest.mark.parametrize(
    ("env", "devices", "warned"),
    [
        ({"K8S_POD_NAME": "vllm-0", "K8S_NAMESPACE_NAME": "serving"}, GPU_A, False),
        ({"K8S_POD_NAME": "sglang-0", "K8S_NAMESPACE_NAME": "serving"}, MIG_B, False),
        ({"K8S_POD_NAME": "idle-0", "K8S_NAMESPACE_NAME": "batch"}, "2", False),  # an index
        ({"K8S_POD_NAME": "nic-0", "K8S_NAMESPACE_NAME": "net"}, None, False),  # no GPU
        ({"K8S_POD_NAME": "gone-0", "K8S_NAMESPACE_NAME": "serving"}, None, True),  # NOT_FOUND
        ({"K8S_POD_NAME": "vllm-0"}, None, False),  # the namespace unknown: not asked
    ],
)
def test_a_sidecar_takes_its_pods_gpus_from_the_kubelet(
    stubs: tuple[ModuleType, ModuleType],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    env: dict[str, str],
    devices: str | None,
    warned: bool,
) -> None:
    sock = tmp_path / "kubelet.sock"
    server = _kubelet(stubs, sock)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_gpu.k8s"):
            assert kubelet_pod_devices(str(sock), env) == devices
    finally:
        server.stop(None)
    assert any("NOT_FOUND" in r.getMessage() for r in caplog.records) == warned
