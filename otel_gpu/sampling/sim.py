"""A simulated GPU, for the demo and for people without a GPU (``--simulate SCENARIO``).

Scenarios:

* ``steady``: model load, warm-up to a plateau with an evaluation sawtooth, busy GPU.
* ``leak``: ``steady`` plus memory that creeps up at ``leak_bytes_per_s`` after warm-up.
* ``stall``: ``steady`` until ``stall_after_s``, then the job keeps its memory while the GPU idles.

The simulation runs on its own clock, ``time_scale`` times faster than the wall clock, and
reports that time as the data time of each reading, so a one-minute demo shows an hour of a job.
Memory is attributed to the watched job's PIDs so per-process series are real processes.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample
from otel_gpu.sampling.source import DeviceReading, HostInfo

GIB = 1024**3
_SIM_UUID = "GPU-51a1a7ed-0000-4000-8000-00000000000{}"


class SimulatedSource:
    """A :class:`~otel_gpu.sampling.source.DeviceSource` backed by a formula, not NVML."""

    def __init__(
        self,
        scenario: str = "steady",
        *,
        gpus: int = 1,
        time_scale: float = 1.0,
        leak_bytes_per_s: float = 2.0 * GIB / 3600.0,
        stall_after_s: float = 1800.0,
        total_bytes: int = 80 * GIB,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 7,
    ) -> None:
        if scenario not in ("steady", "leak", "stall"):
            raise ValueError(f"unknown scenario {scenario!r}")
        self.scenario = scenario
        self.gpus = gpus
        self.time_scale = time_scale
        self.leak_bytes_per_s = leak_bytes_per_s
        self.stall_after_s = stall_after_s
        self.total_bytes = total_bytes
        self._clock = clock
        self._t0 = clock()
        self._wall0 = time.time()
        self._rng = random.Random(seed)
        self._energy_j = [0.0] * gpus
        self._last_t = 0.0

    def elapsed(self) -> float:
        """Simulated seconds since the source was created."""
        return (self._clock() - self._t0) * self.time_scale

    def phase(self, t: float) -> str:
        if t < 120.0:
            return "load"
        if self.scenario != "stall" and (t % 1200.0) >= 1140.0:
            return "evaluate"
        return "train"

    def _job_bytes(self, t: float) -> float:
        """Memory the job holds on one GPU at simulated time ``t``."""
        if t < 120.0:  # loading the model: weights arrive
            return 14 * GIB * (t / 120.0)
        warm = 1.0 - math.exp(-(t - 120.0) / 240.0)  # allocator warm-up toward a plateau
        base = 14 * GIB + 18 * GIB * warm
        saw = 1.5 * GIB * ((t % 300.0) / 300.0)  # activation / eval sawtooth
        leak = 0.0
        if self.scenario == "leak" and t > 600.0:
            leak = self.leak_bytes_per_s * (t - 600.0)
        return min(base + saw + leak, self.total_bytes * 0.995)

    def sample(self, job_pids: Sequence[int]) -> DeviceReading:
        t = self.elapsed()
        dt = max(0.0, t - self._last_t)
        self._last_t = t
        phase = self.phase(t)
        stalled = self.scenario == "stall" and t >= self.stall_after_s
        gpus: list[GpuSample] = []
        procs: list[GpuProcessSample] = []
        pids = list(job_pids)[:1] or []
        for i in range(self.gpus):
            uuid = _SIM_UUID.format(i)
            job = self._job_bytes(t) if pids else 0.0
            noise = self._rng.uniform(-0.02, 0.02)
            if not pids:
                util, power = 0.0, 62.0
            elif phase == "load":
                util, power = 0.05 + noise, 90.0
            elif stalled:
                util, power = max(0.0, 0.02 + noise / 4), 75.0
            elif phase == "evaluate":
                util, power = 0.6 + noise, 420.0
            else:
                util, power = 0.93 + noise, 610.0 + 300 * noise
            self._energy_j[i] += power * dt
            used = int(job + 0.5 * GIB)  # driver and context reservation
            gpus.append(
                GpuSample(
                    uuid=uuid,
                    index=i,
                    name="Simulated H100 80GB",
                    memory_used=used,
                    memory_total=self.total_bytes,
                    util_gpu=min(1.0, max(0.0, util)),
                    util_memory=min(1.0, max(0.0, util * 0.6)),
                    util_encoder=0.0,
                    util_decoder=0.0,
                    power_w=power,
                    power_limit_w=700.0,
                    energy_j=self._energy_j[i],
                    temperature_c=40.0 + 35.0 * util,
                    ecc_corrected=0,
                    ecc_uncorrected=0,
                    xid_errors=0,
                    clock_sm_hz=1.98e9 if util > 0.1 else 3.45e8,
                    clock_mem_hz=2.6e9,
                    processes_listed=True,
                )
            )
            for pid in pids:
                procs.append(
                    GpuProcessSample(
                        pid=pid,
                        gpu_uuid=uuid,
                        used_memory=int(job),
                        sm_util=min(1.0, max(0.0, util)),
                        mem_util=min(1.0, max(0.0, util * 0.6)),
                    )
                )
        return DeviceReading(gpus=tuple(gpus), gpu_processes=tuple(procs), time=self._wall0 + t)

    def host_info(self) -> HostInfo:
        return HostInfo(
            driver_version="simulated",
            cuda_driver_version=None,
            gpu_count=self.gpus,
            gpu_models=("Simulated H100 80GB",) * self.gpus,
        )

    def close(self) -> None:
        return None
