"""The interface between the sampler and whatever provides GPU readings.

Two implementations: :class:`otel_gpu.sampling.nvml.NvmlSource` (the real NVML through pynvml)
and :class:`otel_gpu.sampling.sim.SimulatedSource` (a simulated GPU for the demo and for users
without a GPU). Tests use the real ``NvmlSource`` against ``tests/fakenvml``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """What one device sweep returns."""

    gpus: tuple[GpuSample, ...] = ()
    gpu_processes: tuple[GpuProcessSample, ...] = ()
    no_gpu_reason: str | None = None  # set when no GPU can be read at all (no library, no driver)
    # Data time of the reading (s since epoch) when the source keeps its own clock (simulation);
    # None: the sampler stamps the reading with the wall clock.
    time: float | None = None


@dataclass(frozen=True, slots=True)
class HostInfo:
    """Static facts about the GPU host, for the resource and ``doctor``."""

    driver_version: str | None = None
    cuda_driver_version: str | None = None  # e.g. "12.4"
    gpu_count: int | None = None
    gpu_models: tuple[str, ...] = ()


class DeviceSource(Protocol):
    """Reads GPUs. Called only from the sampler thread; must never raise."""

    def sample(self, job_pids: Sequence[int]) -> DeviceReading:
        """Read every selected GPU and its processes once.

        ``job_pids`` are the watched job's PIDs in the agent's namespace; real NVML ignores them,
        the simulated source attributes its simulated memory to them.
        """
        ...

    def host_info(self) -> HostInfo: ...

    def close(self) -> None: ...
