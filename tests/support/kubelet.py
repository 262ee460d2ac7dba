"""A kubelet PodResources gRPC server on a unix socket, speaking the vendored proto."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_tools import protoc

import otel_gpu.k8s.podresources as podresources

PROTO_DIR = Path(podresources.__file__).parent


def compiled_stubs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ModuleType, ModuleType]]:
    """The kubelet's gRPC stubs, generated from the vendored api.proto (imported while alive)."""
    out = tmp_path_factory.mktemp("podresources_stubs")
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}"]
    assert protoc.main([*args, str(PROTO_DIR / "api.proto")]) == 0
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("api_pb2"), importlib.import_module("api_pb2_grpc")
    finally:
        sys.path.remove(str(out))
        for name in ("api_pb2", "api_pb2_grpc"):
            sys.modules.pop(name, None)


Containers = list[tuple[str, str, tuple[str, ...]]]  # name, resource, device IDs
PodSpec = tuple[str, str, Containers]  # name, namespace, containers


def kubelet(stubs: tuple[ModuleType, ModuleType], path: Path, pods: list[PodSpec]) -> grpc.Server:
    """A PodResources server on ``path`` listing ``pods`` as they are at each call (the test
    may change the list: a pod replaced)."""
    pb2, pb2_grpc = stubs

    def message(name: str, namespace: str, containers: Containers) -> object:
        return pb2.PodResources(name=name, namespace=namespace, containers=[
            pb2.ContainerResources(name=c, devices=[
                pb2.ContainerDevices(resource_name=r, device_ids=list(ids))] if ids else [])
            for c, r, ids in containers
        ])  # fmt: skip

    class Lister(pb2_grpc.PodResourcesListerServicer):
        def List(self, request, context):  # noqa: N802
            return pb2.ListPodResourcesResponse(pod_resources=[message(*p) for p in pods])

        def Get(self, request, context):  # noqa: N802
            for name, namespace, containers in pods:
                if (name, namespace) == (request.pod_name, request.pod_namespace):
                    return pb2.GetPodResourcesResponse(
                        pod_resources=message(name, namespace, containers)
                    )
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_name} not found")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server
