"""``MemTracker``: the allocator's counters sampled at up to 100 Hz on a thread of its own, the
peaks that 1 s NVML sampling misses, per phase and step (issue 20 §5).

    tracker = otel_gpu.MemTracker(device_id=0, interval_ms=50, alert_threshold_mb=8000)
    tracker.start(); ...; tracker.stop(); print(tracker.report())
    with otel_gpu.MemTracker(interval_ms=10) as tracker: ...

On a CUDA build with a GPU it samples ``torch.cuda.memory_allocated / memory_reserved /
max_memory_allocated`` of ``device_id``; elsewhere (CPU builds) the process's RSS. Each sample
is tagged with the phase and step the in-process part knows (``otel_gpu.phase``/``step``,
the HF and Lightning callbacks). ``report()`` gives the peak overall, per phase and per step
(the last :data:`STEPS_KEPT` steps), the samples above ``alert_threshold_mb`` and the top
holders of one live-tensor census taken then (``holders=False`` skips it). The series are
exported as the gauges ``otel_gpu.memtracker.used`` and ``otel_gpu.memtracker.peak`` (bytes)
through the meter provider in use. The sampler thread reads counters only (no NVML, no /proc
beyond this process's own RSS) and never raises into the job; its cost is measured by
``benchmarks/bench_memtracker.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from otel_gpu.tracing import progress

log = logging.getLogger("otel_gpu.tracing")

MIN_INTERVAL_MS = 10.0  # 100 Hz at most
STEPS_KEPT = 256
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> tuple[float, float, float]:
    with open("/proc/self/statm", "rb") as f:
        rss = float(f.read().split()[1]) * _PAGE
    return rss, rss, rss


class MemTracker:
    """See the module docstring."""

    def __init__(
        self,
        device_id: int = 0,
        interval_ms: float = 50.0,
        alert_threshold_mb: float | None = None,
        *,
        read: Callable[[], tuple[float, float, float]] | None = None,
    ) -> None:
        self.device_id = device_id
        self.interval_s = max(MIN_INTERVAL_MS, float(interval_ms)) / 1000.0
        self.threshold = None if alert_threshold_mb is None else alert_threshold_mb * 1e6
        self.source = "rss"
        self._read = read or self._reader()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.samples = 0
        self.peak = 0.0
        self.last = 0.0
        self._phases: dict[str, float] = {}
        self._steps: OrderedDict[int, float] = OrderedDict()
        self._over: list[dict[str, Any]] = []
        self._gauges_registered = False

    def _reader(self) -> Callable[[], tuple[float, float, float]]:
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_available():
                cuda, dev = torch.cuda, self.device_id
                self.source = f"cuda:{dev}"
                return lambda: (
                    float(cuda.memory_allocated(dev)),
                    float(cuda.memory_reserved(dev)),
                    float(cuda.max_memory_allocated(dev)),
                )
        except Exception:  # noqa: BLE001 - a broken CUDA setup: RSS is still worth having
            pass
        return _rss

    # -- sampling -------------------------------------------------------------------------

    def sample(self) -> None:
        """One sample now (the thread calls this; tests may too)."""
        try:
            allocated, _reserved, peak = self._read()
        except Exception:  # noqa: BLE001 - never into the job
            return
        phase = progress.current_phase() or "-"
        step = progress.current_step()
        with self._lock:
            self.samples += 1
            self.last = allocated
            # the allocator's own peak catches what happened between two samples
            self.peak = max(self.peak, allocated, peak)
            self._phases[phase] = max(self._phases.get(phase, 0.0), allocated)
            if step is not None:
                self._steps[step] = max(self._steps.get(step, 0.0), allocated)
                self._steps.move_to_end(step)
                while len(self._steps) > STEPS_KEPT:
                    self._steps.popitem(last=False)
            if self.threshold is not None and allocated > self.threshold and len(self._over) < 100:
                if not self._over:
                    log.warning(
                        "otel-gpu: MemTracker: %s at %.0f MB, over %.0f MB (phase %s, step %s)",
                        self.source, allocated / 1e6, self.threshold / 1e6, phase, step,
                    )  # fmt: skip
                self._over.append(
                    {"time": time.time(), "bytes": allocated, "phase": phase, "step": step}
                )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> MemTracker:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._register_gauges()
            self.sample()
            self._thread = threading.Thread(
                target=self._run, name="otel-gpu-memtracker", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.sample()

    def __enter__(self) -> MemTracker:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- outputs --------------------------------------------------------------------------

    def _register_gauges(self) -> None:
        if self._gauges_registered:
            return
        self._gauges_registered = True
        try:
            from opentelemetry import metrics
            from opentelemetry.metrics import CallbackOptions, Observation

            from otel_gpu.core.signals.reading import observable
            from otel_gpu.core.signals.training import MEMTRACKER_PEAK, MEMTRACKER_USED

            meter = metrics.get_meter("otel_gpu.memtracker")
            attrs = {"otel_gpu.memtracker.source": self.source}

            def used(_o: CallbackOptions) -> Iterable[Observation]:
                return [Observation(self.last, attrs)]

            def peak(_o: CallbackOptions) -> Iterable[Observation]:
                return [Observation(self.peak, attrs)]

            observable(meter, MEMTRACKER_USED, [used])
            observable(meter, MEMTRACKER_PEAK, [peak])
        except Exception:  # noqa: BLE001 - telemetry is optional here
            log.debug("MemTracker gauges not registered", exc_info=True)

    def report(self, *, holders: bool = True, top: int = 5) -> dict[str, Any]:
        """Peaks overall, per phase and per step; samples over the threshold; top holders."""
        with self._lock:
            out: dict[str, Any] = {
                "source": self.source,
                "interval_ms": self.interval_s * 1000,
                "samples": self.samples,
                "peak_bytes": self.peak,
                "last_bytes": self.last,
                "peak_by_phase": dict(self._phases),
                "peak_by_step": dict(self._steps),
                "over_threshold": list(self._over),
            }
        if holders:
            from otel_gpu.diagnose import census

            # On a thread of its own: a census does not see its own thread's frames, and the
            # caller's (the training loop's) locals are what it should name.
            found: list[census.Census] = []
            worker = threading.Thread(
                target=lambda: found.append(census.take()), name="otel-gpu-census", daemon=True
            )
            worker.start()
            worker.join()
            if not found:
                return out
            c = found[0]
            rows = sorted(c.holders.values(), key=lambda h: -h.bytes)[:top]
            out["holders"] = [
                {"path": h.path, "count": h.count, "bytes": h.bytes, "site": h.site} for h in rows
            ]
        return out
