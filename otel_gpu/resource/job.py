"""The job a process belongs to and its place in it, from the environment its launcher set.

``service.instance.id`` names the process, ``otel_gpu.job.id`` the job: one id shared by its
processes (:mod:`otel_gpu.core.job_identity`).
torchrun / torch.distributed (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` or ``NODE_RANK``, ``TORCHELASTIC_RUN_ID``), Slurm (``SLURM_*``) and Kubernetes
(``POD_NAME`` / ``POD_NAMESPACE`` / ``NODE_NAME`` from the downward API, else ``HOSTNAME`` and
the service account's namespace file). Semconv covers only the Kubernetes names; the rest are
documented extensions under ``otel_gpu.``. Only what is set is reported.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource, ResourceDetector
from opentelemetry.util.types import AttributeValue

from otel_gpu.core.job_identity import JOB_ID, SERVICE_INSTANCE_ID, instance_id, job_id

log = logging.getLogger("otel_gpu.resource")

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

# attribute -> environment variables tried in order; ints are ranks and sizes.
_INT_ATTRS: dict[str, tuple[str, ...]] = {
    "otel_gpu.job.rank": ("RANK",),
    "otel_gpu.job.local_rank": ("LOCAL_RANK",),
    "otel_gpu.job.world_size": ("WORLD_SIZE",),
    "otel_gpu.job.local_world_size": ("LOCAL_WORLD_SIZE",),
    "otel_gpu.job.node_rank": ("GROUP_RANK", "NODE_RANK"),
    "otel_gpu.slurm.proc.id": ("SLURM_PROCID",),
    "otel_gpu.slurm.node.id": ("SLURM_NODEID",),
}
# Identifiers stay strings (they are names, not quantities).
_STR_ATTRS: dict[str, tuple[str, ...]] = {
    "otel_gpu.job.run_id": ("TORCHELASTIC_RUN_ID",),
    "otel_gpu.slurm.job.id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "otel_gpu.slurm.job.name": ("SLURM_JOB_NAME",),
    "otel_gpu.slurm.array_job.id": ("SLURM_ARRAY_JOB_ID",),
    "otel_gpu.slurm.array_task.id": ("SLURM_ARRAY_TASK_ID",),
}


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def job_attributes(
    env: Mapping[str, str] | None = None, sa_namespace_file: str = SA_NAMESPACE_FILE
) -> dict[str, AttributeValue]:
    """Job attributes found in ``env`` (default: ``os.environ``).

    A rank or size that is not an integer is left out with a warning naming the variable.
    """
    env = os.environ if env is None else env
    attrs: dict[str, AttributeValue] = {}
    for attr, names in _INT_ATTRS.items():
        found = _first(env, names)
        if found is None:
            continue
        try:
            attrs[attr] = int(found[1])
        except ValueError:
            log.warning("%s=%r is not an integer; %s not recorded", found[0], found[1], attr)
    for attr, names in _STR_ATTRS.items():
        found = _first(env, names)
        if found is not None:
            attrs[attr] = found[1]
    if env.get("KUBERNETES_SERVICE_HOST"):
        attrs.update(_k8s_attributes(env, sa_namespace_file))
    return attrs


def _k8s_attributes(env: Mapping[str, str], sa_namespace_file: str) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {}
    # A pod's hostname is its name unless the spec sets hostname/subdomain.
    pod = env.get("POD_NAME") or env.get("HOSTNAME") or socket.gethostname()
    if pod:
        attrs["k8s.pod.name"] = pod
    namespace = env.get("POD_NAMESPACE")
    if not namespace:
        try:
            with open(sa_namespace_file, encoding="utf-8") as f:
                namespace = f.read(256).strip()
        except OSError:
            namespace = None
    if namespace:
        attrs["k8s.namespace.name"] = namespace
    if env.get("NODE_NAME"):
        attrs["k8s.node.name"] = env["NODE_NAME"]
    if env.get("POD_UID"):
        attrs["k8s.pod.uid"] = env["POD_UID"]
    return attrs


class JobResourceDetector(ResourceDetector):
    """The process's ``service.instance.id`` and the job's ``otel_gpu.job.id``; rank, local rank, world size, node rank, run id, Slurm
    ids and Kubernetes pod identity."""

    def __init__(
        self, raise_on_error: bool = False, *, env: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(raise_on_error)
        self.env = env

    def is_process_dependent(self) -> bool:
        # After a fork (a DataLoader worker) the SDK (1.44+) re-runs the process-dependent
        # detectors over the providers' resource, and its own service_instance detector then
        # hands the child a new random id. Run again after it, this one puts the job's back.
        return True

    def detect(self) -> Resource:
        env = os.environ if self.env is None else self.env
        try:
            return Resource(
                {SERVICE_INSTANCE_ID: instance_id(env), JOB_ID: job_id(env), **job_attributes(env)}
            )
        except Exception as exc:  # never break the SDK's start-up
            log.warning("job attributes not recorded: %s: %s", type(exc).__name__, exc)
            return Resource.get_empty()
