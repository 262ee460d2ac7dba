"""A client of the kubelet's PodResources API (v1, gRPC over a unix socket).

The messages come from the kubelet's own ``api.proto`` (vendored beside this file), compiled to
``api.desc`` by ``grpc_tools.protoc`` (the command is in the .proto's header); they are built
from that descriptor at import, so no generated code pins a protobuf release. ``List`` gives
every pod's containers and the device IDs each was allocated (``Get`` one pod's): GPU UUIDs for ``nvidia.com/gpu``
(the NVIDIA device plugin's default ``uuid`` strategy), MIG UUIDs for ``nvidia.com/mig-*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
SERVICE = "v1.PodResourcesLister"
GPU_RESOURCE_PREFIX = "nvidia.com/"


def _messages() -> dict[str, Any]:
    files = descriptor_pb2.FileDescriptorSet.FromString(
        resources.files("otel_gpu.k8s.podresources").joinpath("api.desc").read_bytes()
    )
    pool = descriptor_pool.DescriptorPool()  # private: never clashes with another "v1" package
    for proto in files.file:
        pool.Add(proto)
    names = ("ListPodResourcesRequest", "ListPodResourcesResponse", "GetPodResourcesRequest",
             "GetPodResourcesResponse", "AllocatableResourcesRequest", "AllocatableResourcesResponse")  # fmt: skip
    return {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{n}")) for n in names
    }


MESSAGES = _messages()


@dataclass(frozen=True, slots=True)
class Allocation:
    """One device allocated to one container."""

    device_id: str  # GPU-..., MIG-... or an index, as the device plugin names it
    resource: str  # nvidia.com/gpu, nvidia.com/mig-1g.10gb, ...
    pod: str
    namespace: str
    container: str


class PodResourcesClient:
    """``List`` on the kubelet socket, bounded by ``timeout_s``; errors are grpc.RpcError."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._list = self._channel.unary_unary(
            f"/{SERVICE}/List",
            request_serializer=MESSAGES["ListPodResourcesRequest"].SerializeToString,
            response_deserializer=MESSAGES["ListPodResourcesResponse"].FromString,
        )
        self._get = self._channel.unary_unary(
            f"/{SERVICE}/Get",
            request_serializer=MESSAGES["GetPodResourcesRequest"].SerializeToString,
            response_deserializer=MESSAGES["GetPodResourcesResponse"].FromString,
        )

    def gpu_allocations(self) -> list[Allocation]:
        """Every NVIDIA device allocated to a container on this node (``List``)."""
        response = self._list(MESSAGES["ListPodResourcesRequest"](), timeout=self.timeout_s)
        return [a for pod in response.pod_resources for a in _gpus(pod)]

    def pod_gpus(self, name: str, namespace: str) -> list[Allocation]:
        """The NVIDIA devices allocated to one pod's containers (``Get``, kubelet 1.27+)."""
        request = MESSAGES["GetPodResourcesRequest"](pod_name=name, pod_namespace=namespace)
        return _gpus(self._get(request, timeout=self.timeout_s).pod_resources)

    def close(self) -> None:
        self._channel.close()


def _gpus(pod: Any) -> list[Allocation]:
    return [
        Allocation(device_id, devices.resource_name, pod.name, pod.namespace, container.name)
        for container in pod.containers
        for devices in container.devices
        if devices.resource_name.startswith(GPU_RESOURCE_PREFIX)
        for device_id in devices.device_ids
    ]
