"""The sampler thread: one NVML + /proc sweep per interval, published as an immutable snapshot.

Nothing here runs on the job's threads. OTel callbacks and the detection engine only read the
latest :class:`Snapshot`; listeners run on this thread after each sweep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from otel_gpu.sampling.procs import ProcessReading
from otel_gpu.sampling.snapshot import ProcessSample, Snapshot
from otel_gpu.sampling.source import DeviceReading, DeviceSource

log = logging.getLogger("otel_gpu.sampler")

Listener = Callable[[Snapshot], None]


class ProcessSource(Protocol):
    """What the sampler needs of :class:`otel_gpu.sampling.procs.ProcessTree`."""

    def sample(self, gpu_pids: Iterable[int] = ...) -> ProcessReading: ...

    def job_pids(self) -> list[int]: ...


class Sampler:
    """Runs sweeps on a daemon thread every ``interval_s`` seconds."""

    def __init__(
        self,
        source: DeviceSource,
        tree: ProcessSource | None = None,
        *,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.tree = tree
        self.interval_s = interval_s
        self._clock = clock
        self._latest: Snapshot | None = None
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing_listeners: set[int] = set()
        self.sweeps = 0

    @property
    def latest(self) -> Snapshot | None:
        """The last published snapshot (an atomic reference read; never blocks)."""
        return self._latest

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def sample_once(self) -> Snapshot:
        """Sweep devices and processes once and publish the snapshot. Never raises."""
        started = time.perf_counter()
        job_pids = self.tree.job_pids() if self.tree is not None else []
        try:
            reading = self.source.sample(job_pids)
        except Exception:  # a source must not raise; if it does, the agent keeps going
            log.exception("GPU source failed; reporting no GPU data for this sweep")
            reading = DeviceReading(no_gpu_reason="GPU source error")
        processes: tuple[ProcessSample, ...] = ()
        dropped = 0
        unmapped: tuple[int, ...] = ()
        host_to_local: dict[int, int] = {}
        if self.tree is not None:
            gpu_pids = sorted({p.pid for p in reading.gpu_processes})
            try:
                procs = self.tree.sample(gpu_pids)
                processes = procs.processes
                dropped = procs.dropped
                unmapped = procs.unmapped_gpu_pids
                host_to_local = procs.host_to_local
            except Exception:
                log.exception("process sampling failed; reporting no process data for this sweep")
        snap = Snapshot(
            time=reading.time if reading.time is not None else self._clock(),
            gpus=reading.gpus,
            gpu_processes=reading.gpu_processes,
            processes=processes,
            processes_dropped=dropped,
            unmapped_gpu_pids=unmapped,
            host_to_local=host_to_local,
            no_gpu_reason=reading.no_gpu_reason,
            sweep_seconds=time.perf_counter() - started,
        )
        self._latest = snap
        self.sweeps += 1
        for listener in list(self._listeners):
            try:
                listener(snap)
            except Exception:
                if id(listener) not in self._failing_listeners:
                    self._failing_listeners.add(id(listener))
                    log.exception("snapshot listener %r failed (logged once)", listener)
        return snap

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="otel-gpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.sample_once()
            # Fixed rate, not fixed delay: a slow sweep shortens the next wait, never stacks.
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded) and close the source."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        try:
            self.source.close()
        except Exception:
            log.debug("closing the GPU source failed", exc_info=True)
