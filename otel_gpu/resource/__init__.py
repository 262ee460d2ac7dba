"""OpenTelemetry resource detectors: git provenance, the GPU host, the job (its
``service.instance.id``, shared by its processes) and each process's place in it.

Registered under the ``opentelemetry_resource_detector`` entry point group as ``otel_gpu_git``,
``otel_gpu_host`` and ``otel_gpu_job``, so ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS`` selects them
(``opentelemetry-instrument`` and ``Resource.create()`` both honour it). Each ``detect()`` is
bounded in time and never raises: on failure it logs one warning and returns an empty resource.
"""

from __future__ import annotations

from otel_gpu.resource.git import GitResourceDetector, canonical_repo_url, git_attributes
from otel_gpu.resource.host import GpuHostResourceDetector, host_attributes
from otel_gpu.resource.job import JobResourceDetector, job_attributes

__all__ = [
    "GitResourceDetector",
    "GpuHostResourceDetector",
    "JobResourceDetector",
    "canonical_repo_url",
    "git_attributes",
    "host_attributes",
    "job_attributes",
]
