"""GPU host facts as resource attributes: driver versions, GPU count and models.

Semconv has no attributes for these, so they are documented extensions under ``otel_gpu.``.
NVML is asked through :meth:`otel_gpu.sampling.nvml.NvmlSource.host_info` in a short-lived
child process (:class:`NvmlHostProbe`), waited for on a helper thread with a deadline: a driver
fault that aborts or segfaults ``nvmlInit`` ends that child, never the job (resource detection
runs inside every ``opentelemetry-instrument``-ed process) or the ``otel-gpu run`` wrapper, and a
hung driver can't hold up the SDK's start-up (whose executor would wait for a blocked detector
forever).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from typing import Protocol

from opentelemetry.sdk.resources import Resource, ResourceDetector
from opentelemetry.util.types import AttributeValue

from otel_gpu.core.child_python import python_argv
from otel_gpu.sampling.source import HostInfo

log = logging.getLogger("otel_gpu.resource")

GPU_DRIVER_VERSION = "otel_gpu.gpu.driver.version"  # e.g. "550.54.15"
GPU_CUDA_DRIVER_VERSION = "otel_gpu.gpu.cuda_driver.version"  # e.g. "12.4"
GPU_COUNT = "otel_gpu.gpu.count"  # int: GPUs the driver lists on the host
GPU_MODELS = "otel_gpu.gpu.models"  # string[]: model name per GPU index

DEFAULT_TIMEOUT_S = 3.0  # below the SDK's 5 s per-detector limit


class HostInfoSource(Protocol):
    def host_info(self) -> HostInfo: ...

    def close(self) -> None: ...


def host_attributes(info: HostInfo) -> dict[str, AttributeValue]:
    """Resource attributes for ``info``; unknown fields are left out (never 0 or "")."""
    attrs: dict[str, AttributeValue] = {}
    if info.driver_version:
        attrs[GPU_DRIVER_VERSION] = info.driver_version
    if info.cuda_driver_version:
        attrs[GPU_CUDA_DRIVER_VERSION] = info.cuda_driver_version
    if info.gpu_count is not None:
        attrs[GPU_COUNT] = info.gpu_count
    if info.gpu_models:
        attrs[GPU_MODELS] = list(info.gpu_models)
    return attrs


_PROBE = "from otel_gpu.resource.host import print_host_info; print_host_info()"


class NvmlHostProbe:
    """:class:`HostInfo` read from NVML by a child process (a fresh interpreter without
    OpenTelemetry auto-instrumentation), killed if it outlives ``timeout_s``."""

    def __init__(self, library_path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.library_path = library_path
        self.timeout_s = timeout_s

    def host_info(self) -> HostInfo:
        from otel_gpu.sampling.isolated import child_environment, describe_exit

        env = child_environment()
        if self.library_path:
            env["OTEL_GPU_NVML_LIBRARY"] = self.library_path
        try:
            proc = subprocess.run(
                python_argv("-c", _PROBE),
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,  # its "no GPU" warnings are the detector's to report
                text=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"NVML did not answer in {self.timeout_s:g}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"the NVML probe process {describe_exit(proc.returncode)}")
        fields = json.loads(proc.stdout)
        fields["gpu_models"] = tuple(fields["gpu_models"])
        return HostInfo(**fields)

    def close(self) -> None:
        """Nothing to release: the child process has ended."""


def host_info_source(simulate: str | None, library_path: str | None) -> HostInfoSource:
    """The simulated GPU for ``simulate`` (a scenario name), else NVML through a child process."""
    if simulate:
        from otel_gpu.sampling.sim import SimulatedSource

        return SimulatedSource(simulate)
    return NvmlHostProbe(library_path)


def _default_source() -> HostInfoSource:
    """From ``OTEL_GPU_SIMULATE`` and ``OTEL_GPU_NVML_LIBRARY`` (the library file when set)."""
    return host_info_source(
        os.environ.get("OTEL_GPU_SIMULATE", "").strip() or None,
        os.environ.get("OTEL_GPU_NVML_LIBRARY", "").strip() or None,
    )


class GpuHostResourceDetector(ResourceDetector):
    """Driver version, CUDA driver version, GPU count and models of this host.

    Without NVML (no driver, no GPU) the resource is empty and one warning is logged.
    ``source_factory`` builds the source of :class:`HostInfo` (default: the simulated GPU when
    ``OTEL_GPU_SIMULATE`` is set, else NVML read by a child process: :class:`NvmlHostProbe`).
    """

    def __init__(
        self,
        raise_on_error: bool = False,
        *,
        source_factory: Callable[[], HostInfoSource] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(raise_on_error)
        self.source_factory = source_factory or _default_source
        self.timeout_s = timeout_s

    def detect(self) -> Resource:
        result: list[HostInfo] = []
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                source = self.source_factory()
                try:
                    result.append(source.host_info())
                finally:
                    source.close()
            except BaseException as exc:  # reported by detect(); a thread must not die loudly
                errors.append(exc)

        # A daemon thread, not the SDK's executor: if NVML hangs, the process can still exit.
        worker = threading.Thread(target=ask, name="otel-gpu-host-info", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            log.warning(
                "GPU host attributes not recorded: NVML did not answer in %gs", self.timeout_s
            )
            return Resource.get_empty()
        if errors:
            exc = errors[0]
            log.warning("GPU host attributes not recorded: %s: %s", type(exc).__name__, exc)
            return Resource.get_empty()
        attrs = host_attributes(result[0]) if result else {}
        if not attrs:
            # INFO: the sampler says "no GPU data" (with the reason and the fix) as a warning.
            log.info("GPU host attributes not recorded: no NVIDIA driver or GPU found")
        return Resource(attrs)


def print_host_info() -> None:
    """The child's side of :class:`NvmlHostProbe`: print this host's :class:`HostInfo` as JSON."""
    from otel_gpu.sampling.nvml import NvmlSource  # imported late: it loads pynvml

    source = NvmlSource(library_path=os.environ.get("OTEL_GPU_NVML_LIBRARY") or None)
    try:
        info = source.host_info()
    finally:
        source.close()
    print(json.dumps(dataclasses.asdict(info)))
