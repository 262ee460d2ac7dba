"""The sampling loop: one NVML + /proc sweep per interval, published as an immutable snapshot.

:class:`Sampler` runs the sweeps on a daemon thread of the process it lives in. The agent runs
it inside a supervised helper process (:mod:`otel_gpu.sampling.isolated`), so a crash or hang in
NVML or a /proc read never reaches the job; tests and the demo, which inject their own source
objects, run it on a thread. Both publish through the same :class:`Published` record, so OTel
callbacks and the detection engine read the latest snapshot the same way and never get a stale
one (:meth:`Published.fresh`).
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

# A snapshot older than this many sampling intervals (and at least STALE_MIN_S) is stale: the
# instruments skip it rather than re-export old values with fresh timestamps.
STALE_INTERVALS = 3.0
STALE_MIN_S = 3.0


def stale_after(interval_s: float) -> float:
    """Seconds after which a snapshot sampled every ``interval_s`` counts as stale."""
    return max(STALE_INTERVALS * interval_s, STALE_MIN_S)


class Published:
    """The latest snapshot and when it arrived (monotonic), read without locks by callbacks.

    The arrival time, not the snapshot's data time, decides freshness: a simulated source keeps
    its own (accelerated) clock, and a sweep that cannot finish produces no new snapshot at all.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after(interval_s)
        self._clock = clock
        self._created = clock()
        self._sampled_at: float | None = None  # arrival of the last sampled (not down) snapshot
        self._latest: tuple[Snapshot, float] | None = None
        self._listeners: list[Listener] = []
        self._failing_listeners: set[int] = set()
        self.sweeps = 0
        # NVML error counts: those of earlier sampling processes plus the current one's.
        self._errors_base: dict[str, int] = {}
        self._errors_now: tuple[tuple[str, int], ...] = ()

    @property
    def latest(self) -> Snapshot | None:
        """The last published snapshot, however old (an atomic reference read)."""
        entry = self._latest
        return entry[0] if entry is not None else None

    def fresh(self) -> Snapshot | None:
        """The last snapshot if it is younger than :attr:`stale_after_s`, else None."""
        entry = self._latest
        if entry is None or self._clock() - entry[1] > self.stale_after_s:
            return None
        return entry[0]

    def age(self) -> float:
        """Seconds since the last sampled snapshot arrived (before the first: since this was
        built). A "down" snapshot (published without notifying: the sampler is restarting) does
        not count: it is a current fact for the instruments, but nothing was sampled."""
        since = self._created if self._sampled_at is None else self._sampled_at
        return max(0.0, self._clock() - since)

    def nvml_errors(self) -> dict[str, int]:
        """NVML errors by name since the agent started (across sampler restarts)."""
        totals = dict(self._errors_base)
        for name, count in self._errors_now:
            totals[name] = totals.get(name, 0) + count
        return totals

    def carry_errors(self) -> None:
        """A new sampling process starts counting from 0: keep what the last one counted."""
        self._errors_base = self.nvml_errors()
        self._errors_now = ()

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def publish(self, snap: Snapshot, *, notify: bool = True) -> None:
        """Make ``snap`` the latest; then, with ``notify``, hand it to every listener."""
        now = self._clock()
        self._latest = (snap, now)
        if not notify:
            return
        self._sampled_at = now
        self._errors_now = snap.nvml_errors
        self.sweeps += 1
        for listener in list(self._listeners):
            try:
                listener(snap)
            except Exception:
                if id(listener) not in self._failing_listeners:
                    self._failing_listeners.add(id(listener))
                    log.exception("snapshot listener %r failed (logged once)", listener)


class ProcessSource(Protocol):
    """What the sampler needs of :class:`otel_gpu.sampling.procs.ProcessTree`."""

    def sample(self, gpu_pids: Iterable[int] = ...) -> ProcessReading: ...

    def job_pids(self) -> list[int]: ...


class Sampler(Published):
    """Runs sweeps on a daemon thread every ``interval_s`` seconds."""

    restarts = 0  # a thread sampler is never restarted (see SamplerProcess)

    def __init__(
        self,
        source: DeviceSource,
        tree: ProcessSource | None = None,
        *,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` stamps snapshots (wall time); ``monotonic`` judges their freshness."""
        super().__init__(interval_s, monotonic)
        self.source = source
        self.tree = tree
        self.interval_s = interval_s
        self._wall = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Sweeps between two /proc reads of the tree (adaptive sampling, budget.py): in the
        # sweeps between, the last reading is carried, as the slow NVML metrics are.
        self.process_every = 1
        self._sweeps_done = 0
        self._last_procs: ProcessReading | None = None

    def sample_once(self) -> Snapshot:
        """Sweep devices and processes once and publish the snapshot. Never raises."""
        snap = self.sweep()
        self.publish(snap)
        return snap

    def sweep(self) -> Snapshot:
        """Sweep devices and processes once (without publishing). Never raises."""
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
            self._sweeps_done += 1
            try:
                carried = self._last_procs
                if carried is not None and self._sweeps_done % max(1, self.process_every):
                    procs = carried
                else:
                    procs = self._last_procs = self.tree.sample(gpu_pids)
                processes = procs.processes
                dropped = procs.dropped
                unmapped = procs.unmapped_gpu_pids
                host_to_local = procs.host_to_local
            except Exception:
                log.exception("process sampling failed; reporting no process data for this sweep")
        errors = getattr(self.source, "error_counts", None)
        return Snapshot(
            time=reading.time if reading.time is not None else self._wall(),
            gpus=reading.gpus,
            gpu_processes=reading.gpu_processes,
            processes=processes,
            processes_dropped=dropped,
            unmapped_gpu_pids=unmapped,
            host_to_local=host_to_local,
            no_gpu_reason=reading.no_gpu_reason,
            sweep_seconds=time.perf_counter() - started,
            nvml_errors=tuple(sorted(errors.items())) if errors else (),
        )

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
            self.wait_next(began)

    def wait_next(self, began: float) -> None:
        """Wait until the next sweep is due after one that began at ``began`` (monotonic), or
        until :meth:`wake`. Fixed rate, not fixed delay: a slow sweep shortens the wait."""
        self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - began)))
        self._wake.clear()

    def wake(self) -> None:
        """Start the next sweep now instead of at the end of the interval."""
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded) and close the source."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        try:
            self.source.close()
        except Exception:
            log.debug("closing the GPU source failed", exc_info=True)
