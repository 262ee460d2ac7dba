"""The sampling helper process: ``python -m otel_gpu.sampling.worker`` (started by
:class:`otel_gpu.sampling.isolated.SamplerProcess`, never by hand).

Reads one JSON :class:`~otel_gpu.sampling.isolated.SamplerSpec` line on stdin, then runs the
ordinary :class:`~otel_gpu.sampling.sampler.Sampler` sweeps and writes each snapshot as one frame
on stdout. A ``stop`` line on stdin, or the end of stdin (the agent exited, however it died),
ends the helper. A monitor thread ends a sweep stuck longer than
``hang_after_s`` by reporting the PID whose /proc read blocked and exiting, so the agent can
start a helper that skips it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import BinaryIO

from otel_gpu.core.printable import PrintableFormatter
from otel_gpu.sampling.budget import (
    PROCESS_DETAILS,
    PROCESS_GPU_UTIL,
    BudgetController,
    HostCpu,
    agent_cpu_seconds,
)
from otel_gpu.sampling.isolated import EXIT_HUNG, SamplerSpec
from otel_gpu.sampling.procs import ProcessTree
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.source import DeviceSource
from otel_gpu.sampling.wire import FrameWriter as Frames

log = logging.getLogger("otel_gpu.sampler.worker")


def build_source(spec: SamplerSpec) -> DeviceSource:
    """The simulated GPU when asked for, else real NVML (which degrades to "no GPU" mode)."""
    if spec.simulate:
        from otel_gpu.sampling.sim import SimulatedSource

        return SimulatedSource(spec.simulate, time_scale=spec.simulate_speed)
    from otel_gpu.sampling.nvml import NvmlSource

    return NvmlSource(
        call_timeout_s=spec.nvml_timeout_s,
        library_path=spec.nvml_library,
        visible_devices=spec.visible_devices,
        kernel_log=spec.kernel_log,
    )


class FrameWriter:
    """Writes frames to the agent; a closed pipe (the agent is gone) ends the helper."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._frames = Frames()

    def send(self, message: tuple[object, ...]) -> None:
        with self._lock:  # encoded under the lock: the frames share the stream's tables
            data = self._frames.frame(message)
            try:
                self._stream.write(data)
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                os._exit(0)


class HangMonitor:
    """Ends the helper when one sweep has run longer than ``hang_after_s``."""

    def __init__(self, hang_after_s: float, writer: FrameWriter) -> None:
        self.hang_after_s = hang_after_s
        self.busy_since: float | None = time.monotonic()  # start-up counts as a sweep
        self.tree: ProcessTree | None = None
        self.source: DeviceSource | None = None
        self._writer = writer
        threading.Thread(target=self._watch, name="otel-gpu-hang-monitor", daemon=True).start()

    def _next_check_s(self, now: float) -> float:
        """Seconds until a sweep or an NVML call could first be late. A sleep that long, not a
        fixed tick: four wake-ups a second cost this helper a third of its CPU on a slow VM.
        At least a twentieth of the limit (a sweep that began just before the check is looked
        at again that soon), at most the limit: a hang is found within 1.05 x the limit."""
        limit = self.hang_after_s
        due = limit
        since = self.busy_since
        if since is not None:
            due = since + limit - now
        stuck = getattr(self.source, "stuck_seconds", None)
        if stuck is not None:
            held = stuck()
            if held > 0:
                due = min(due, limit - held)
        return min(limit, max(limit / 20, due))

    def _watch(self) -> None:
        while True:
            time.sleep(self._next_check_s(time.monotonic()))
            since = self.busy_since
            if since is not None and time.monotonic() - since > self.hang_after_s:
                pid = self.tree.reading_pid if self.tree is not None else None
                self._writer.send(("hung", {"pid": pid}))
                os._exit(EXIT_HUNG)
            # A hung NVML call is abandoned by its deadline and the sweeps go on without that
            # GPU, but the stuck call never gives the library back: a new process does.
            stuck = getattr(self.source, "stuck_seconds", None)
            if stuck is not None and stuck() > self.hang_after_s:
                self._writer.send(("hung", {"nvml": True}))
                os._exit(EXIT_HUNG)


def main() -> int:
    # The frame stream is a private copy of stdout; fd 1 itself goes to stderr, so a stray
    # print (ours or a library's) can never corrupt it.
    frames = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable()  # a native crash leaves the Python stack on stderr
    spec = SamplerSpec.from_json(sys.stdin.readline() or "{}")
    handler = logging.StreamHandler()  # stderr: the wrapper's terminal
    handler.setFormatter(PrintableFormatter("otel-gpu: %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=spec.log_level, handlers=[handler])
    writer = FrameWriter(frames)
    monitor = HangMonitor(spec.hang_after_s, writer)
    tree = ProcessTree(
        (),
        proc_root=spec.proc_root,
        max_processes=spec.max_processes,
        discovery_period_s=spec.discovery_period_s,
        skip_pids=spec.skip_pids,
        command_mode=spec.process_command,
    )
    monitor.tree = tree
    tree.set_roots(spec.roots)  # reads /proc: under the monitor's eye
    source = build_source(spec)
    monitor.source = source
    sampler = Sampler(source, tree, interval_s=spec.interval_s)
    sampler.add_listener(lambda snap: writer.send(("snapshot", snap)))
    stop = threading.Event()
    budget = BudgetController(spec.cpu_budget, window_s=spec.budget_window_s)
    host = HostCpu(spec.proc_root)

    def control() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
            if line.startswith("protect "):  # a detector judges a leak or stall: slow nothing
                budget.protected = line.split()[1] == "1"
            if line.strip() == "sweep":  # the agent wants a sweep now (the job just ended)
                sampler.wake()
        stop.set()  # end of stdin: the agent is gone or asked us to stop
        sampler.wake()

    threading.Thread(target=control, name="otel-gpu-control", daemon=True).start()
    try:
        while not stop.is_set():
            began = time.monotonic()
            monitor.busy_since = began
            snap = sampler.sweep()
            # Only the sweep is watched: a write to a busy agent may wait, it is no hang.
            monitor.busy_since = None
            if spec.cpu_budget > 0:
                budget.observe(lambda: agent_cpu_seconds(spec.parent_pid), host.busy)
                sampler.process_every = budget.every(PROCESS_DETAILS)
                if hasattr(source, "process_util_every"):
                    source.process_util_every = budget.every(PROCESS_GPU_UTIL)
                snap = dataclasses.replace(snap, intervals=budget.intervals(spec.interval_s))
            sampler.publish(snap)
            if spec.parent_pid and os.getppid() != spec.parent_pid:
                break  # re-parented: the agent died without closing our stdin
            sampler.wait_next(began)
    finally:
        monitor.busy_since = None
        try:
            sampler.source.close()
        except Exception:
            log.debug("closing the GPU source failed", exc_info=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
