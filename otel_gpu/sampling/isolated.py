"""Sampling in a supervised helper process, so nothing NVML or /proc does can reach the job.

NVML is a native library: a bug in it or in the driver can abort or segfault the process that
calls it, and a call can hang for minutes. A /proc read can block too (a process in
uninterruptible sleep, a FUSE-backed file). Run in the job's process (``opentelemetry-instrument``)
or in the ``otel-gpu run`` wrapper, either would take the job down or leave it unwatched. So the
agent runs every NVML and /proc read in a helper process (:mod:`otel_gpu.sampling.worker`):

* started with a fresh ``exec`` of the interpreter, never a ``fork`` of a process that may hold
  CUDA or NCCL state, in its own session (a terminal's Ctrl-C does not reach it) and with
  OpenTelemetry's auto-instrumentation removed from its environment;
* handing one compact snapshot per sweep to the agent over a pipe (:mod:`otel_gpu.sampling.wire`:
  length-prefixed ``marshal`` frames of plain values, each record's static fields sent once);
* supervised here: when it dies (abort, segfault, exit) or stops delivering snapshots for
  :attr:`SamplerProcess.kill_after_s`, it is killed if need be and started again with
  exponential backoff. The helper watches its own sweeps too: a sweep stuck in a /proc read for
  ``hang_after_s`` makes it report the PID it was reading and exit, and the next helper skips
  that PID, so sampling resumes without it.

While the helper is down the agent publishes the last known GPUs with ``hw.status`` degraded and
no values: a current fact ("cannot be read now"), never a stale value with a fresh timestamp.
One warning is logged when an episode of failures starts, one line when it ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from otel_gpu.core.child_python import python_argv
from otel_gpu.sampling.sampler import Published
from otel_gpu.sampling.snapshot import STATUS_DEGRADED, GpuSample, Snapshot
from otel_gpu.sampling.wire import FrameReader

log = logging.getLogger("otel_gpu.sampler")

EXIT_HUNG = 70  # the helper's exit code after it reported a hung sweep
HEALTHY_AFTER_S = 300.0  # a helper that has run this long ends a failure episode
SKIP_FOR_S = 600.0  # a PID whose /proc read hung is skipped this long


@dataclass(frozen=True)
class SamplerSpec:
    """Everything the helper process needs to build its source and process tree (JSON-safe)."""

    interval_s: float = 5.0
    simulate: str | None = None
    simulate_speed: float = 1.0  # OTEL_GPU_SIMULATE_SPEED: simulated time runs this much faster
    nvml_timeout_s: float = 2.0
    nvml_library: str | None = None
    kernel_log: str | None = None  # Xids from the kernel log too (/dev/kmsg)
    visible_devices: str | None = None
    proc_root: str = "/proc"
    max_processes: int = 256
    discovery_period_s: float = 5.0
    roots: tuple[int, ...] = ()
    skip_pids: tuple[int, ...] = ()  # PIDs whose /proc reads hung in an earlier helper
    process_command: str = "redacted"  # OTEL_GPU_PROCESS_COMMAND (otel_gpu.core.redact)
    log_level: int = logging.WARNING
    parent_pid: int = 0
    cpu_budget: float = 0.0  # OTEL_GPU_CPU_BUDGET, percent of one core; 0: no adaptation
    budget_window_s: float = 10.0  # how long the agent's cost is measured before each decision

    @property
    def hang_after_s(self) -> float:
        """A sweep running this long is stuck: NVML calls have their own deadline (a sweep
        waits at most twice ``nvml_timeout_s`` on NVML), so the rest is a blocked /proc read."""
        return max(3.0 * self.interval_s, 2.0 * self.nvml_timeout_s + 3.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SamplerSpec:
        raw = json.loads(text)
        raw["roots"] = tuple(raw.get("roots", ()))
        raw["skip_pids"] = tuple(raw.get("skip_pids", ()))
        return cls(**raw)


def child_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The helper's environment: the agent's, without OpenTelemetry auto-instrumentation (the
    helper must not start an SDK or a second agent) and with this package importable."""
    env = dict(os.environ if base is None else base)
    keep = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.basename(os.path.normpath(p)) != "auto_instrumentation"
    ]
    import otel_gpu

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(otel_gpu.__file__)))
    # Appended: where otel_gpu came from must be importable, but must not shadow anything the
    # user's PYTHONPATH (or the standard library) provides.
    env["PYTHONPATH"] = os.pathsep.join([*keep, package_parent])
    env["OTEL_SDK_DISABLED"] = "true"
    env["OTEL_GPU_ROLE"] = "off"
    env.pop("OTEL_PYTHON_DISTRO", None)
    return env


def describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == EXIT_HUNG:
        return "hung in a sweep"
    return f"exited with code {code}"


class SamplerProcess(Published):
    """Runs the sampler in a helper process and republishes its snapshots here.

    The same reading surface as :class:`~otel_gpu.sampling.sampler.Sampler` (``latest``,
    ``fresh()``, ``age()``, ``add_listener``, ``sweeps``); listeners run on this object's
    supervisor thread, never on the job's threads.
    """

    def __init__(
        self,
        spec: SamplerSpec,
        *,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        command: Sequence[str] | None = None,
    ) -> None:
        super().__init__(spec.interval_s, clock)
        self.spec = spec
        self.interval_s = spec.interval_s
        # The helper watches its own sweeps (hang_after_s); this is the backstop for a helper
        # that cannot even do that (a deadlock holding the interpreter).
        self.kill_after_s = spec.hang_after_s + max(2.0 * spec.interval_s, 5.0)
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._command = list(command or python_argv("-m", "otel_gpu.sampling.worker"))
        self._skip: dict[int, float] = dict.fromkeys(spec.skip_pids, clock())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._child_lock = threading.Lock()
        self.restarts = 0  # helpers started after the first
        self.last_failure: str | None = None
        self._episode_failures = 0
        self._started_at = 0.0
        self._hung_what: str | None = None  # what the helper said it hung in, before exiting
        self._grace_s = 0.0  # how long stop() lets a helper exit by itself
        self._first_sweep_logged = False
        self.protected = False

    # -- public surface ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._supervise, name="otel-gpu-sampler-supervisor", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        """Ask the helper for a sweep now instead of at the end of its interval."""
        self._send("sweep")

    def protect(self, on: bool) -> None:
        """While ``on`` (a detector suspects or confirmed a leak or stall), the helper slows no
        read to keep its CPU budget; a restarted helper is told again."""
        self.protected = on
        self._send("protect 1" if on else "protect 0")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the helper (asked, then killed at half the bound) and the supervisor."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        self._grace_s = max(0.0, timeout_s / 2)
        self._send("stop")
        with self._child_lock:
            child = self._child
        if child is not None:
            self._end_child(child, self._grace_s)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        delay = self._backoff_initial
        while not self._stop.is_set():
            child = self._spawn()
            what = "could not be started" if child is None else self._pump(child)
            if self._stop.is_set():
                break
            self.last_failure = f"sampler process {what}"
            healthy_run = child is not None and self._clock() - self._started_at >= HEALTHY_AFTER_S
            if healthy_run:
                delay = self._backoff_initial
            self._report_failure(what, delay)
            self._wait_out(delay)
            delay = min(delay * 2.0, self._backoff_max)
            if not self._stop.is_set():
                self.restarts += 1

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        spec = replace(
            self.spec,
            skip_pids=tuple(sorted(self._skipped())),
            log_level=logging.getLogger("otel_gpu").getEffectiveLevel(),
            parent_pid=os.getpid(),
        )
        try:
            child = subprocess.Popen(
                self._command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=child_environment(),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            log.debug("cannot start the sampler process: %s", exc)
            return None
        assert child.stdin is not None
        try:
            child.stdin.write(spec.to_json().encode() + b"\n")
            child.stdin.flush()
            if self.protected:
                child.stdin.write(b"protect 1\n")
                child.stdin.flush()
        except OSError:
            pass  # it died at once; _pump sees the EOF
        with self._child_lock:
            self._child = child
            stopping = self._stop.is_set()
        if stopping:  # stop() ran while this helper was being started: it never saw it
            self._end_child(child, 0.0)
        self.carry_errors()
        self._started_at = self._clock()
        self._first_sweep_logged = False
        log.info(
            "sampling helper process started (PID %d): %s, every %g s",
            child.pid,
            f"simulated GPU ({spec.simulate})" if spec.simulate else "NVML",
            spec.interval_s,
        )
        return child

    def _pump(self, child: subprocess.Popen[bytes]) -> str:
        """Republish the helper's snapshots until it ends, stalls or is stopped; how it ended.
        The helper is always ended, reaped and its pipes closed before this returns."""
        assert child.stdout is not None
        fd = child.stdout.fileno()
        frames = FrameReader()
        last = self._clock()
        what: str | None = None
        # poll, not select: the agent's process (a trainer) may hold more than 1024 files.
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            while True:
                ready = poller.poll(500)
                if self._stop.is_set():
                    what = "stopped"
                    self._end_child(child, self._grace_s)
                    break
                if not ready:
                    if self._clock() - last > self.kill_after_s:
                        what = "stopped delivering snapshots"
                        self._end_child(child, 0.0)
                        break
                    continue
                data = os.read(fd, 1 << 20)
                if not data:
                    break
                for message in frames.feed(data):
                    last = self._clock()
                    self._handle(message)
        except (OSError, ValueError) as exc:
            what = f"sent a broken stream ({exc})"
            self._end_child(child, 0.0)
        finally:
            code = self._reap(child)
        hung, self._hung_what = self._hung_what, None
        if what is not None:
            return what
        return hung if code == EXIT_HUNG and hung else describe_exit(code)

    def _reap(self, child: subprocess.Popen[bytes]) -> int | None:
        """Wait for an ended helper (killing it if it lingers), close its pipes, forget it."""
        try:
            code = child.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                child.kill()  # our own helper process, never the job
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=2.0)
            code = child.returncode
        with self._child_lock:
            self._child = None
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        return code

    def _skipped(self) -> set[int]:
        """PIDs whose /proc reads hung, for at most SKIP_FOR_S (a PID is reused; a transient
        block, e.g. on the job's root, must not drop the process for the rest of the run)."""
        now = self._clock()
        self._skip = {pid: at for pid, at in self._skip.items() if now - at < SKIP_FOR_S}
        return set(self._skip)

    def _handle(self, message: object) -> None:
        if not isinstance(message, tuple) or not message:
            return
        if message[0] == "snapshot":
            snap = message[1]
            if not self._first_sweep_logged:
                self._first_sweep_logged = True
                log.info(
                    "first sweep: %d GPU(s), %d process(es), %.1f ms%s",
                    len(snap.gpus),
                    len(snap.processes),
                    1000 * (snap.sweep_seconds or 0.0),
                    f" ({snap.no_gpu_reason})" if snap.no_gpu_reason else "",
                )
            if self._episode_failures and self._clock() - self._started_at >= HEALTHY_AFTER_S:
                log.warning(
                    "sampler process healthy again after %d failure(s)", self._episode_failures
                )
                self._episode_failures = 0
            self.publish(snap)
        elif message[0] == "hung":
            info = message[1] if len(message) > 1 and isinstance(message[1], dict) else {}
            pid = info.get("pid")
            if info.get("nvml"):
                self._hung_what = "hung in an NVML call"
            elif isinstance(pid, int):
                self._hung_what = f"hung reading /proc/{pid}"
            if isinstance(pid, int):
                self._skip[pid] = self._clock()
                log.warning(
                    "a /proc read of PID %d hung for %.0f s; that process is not sampled for the "
                    "next %.0f min",
                    pid,
                    self.spec.hang_after_s,
                    SKIP_FOR_S / 60,
                )

    def _report_failure(self, what: str, delay: float) -> None:
        self._episode_failures += 1
        if self._episode_failures == 1:
            log.warning(
                "the sampler process %s; the job is not affected; restarting it in %.1f s "
                "(with backoff while it keeps failing)",
                what,
                delay,
            )
        else:
            log.debug("sampler process %s again; restarting in %.1f s", what, delay)

    def _wait_out(self, delay: float) -> None:
        """Publish the GPUs as unreadable now (not their old values) until the restart."""
        deadline = self._clock() + delay
        while not self._stop.is_set():
            self.publish(self._down_snapshot(), notify=False)
            left = deadline - self._clock()
            if left <= 0:
                return
            self._stop.wait(min(left, self.interval_s))

    def _down_snapshot(self) -> Snapshot:
        last = self.latest
        gpus: tuple[GpuSample, ...] = ()
        if last is not None:
            gpus = tuple(
                GpuSample(
                    uuid=g.uuid, index=g.index, name=g.name, status=STATUS_DEGRADED, parent=g.parent
                )
                for g in last.gpus
            )
        return Snapshot(
            time=time.time(),
            gpus=gpus,
            no_gpu_reason=f"{self.last_failure}; restarting",
        )

    def _send(self, command: str) -> None:
        with self._child_lock:
            child = self._child
            if child is None or child.stdin is None:
                return
            try:
                child.stdin.write(command.encode() + b"\n")
                child.stdin.flush()
            except (OSError, ValueError):
                pass

    def _end_child(self, child: subprocess.Popen[bytes], grace_s: float) -> None:
        """Close the helper's stdin (it exits at EOF), then kill it after ``grace_s``."""
        try:
            if child.stdin is not None:
                child.stdin.close()
        except OSError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace_s) if grace_s > 0 else None
        if child.poll() is None:
            with contextlib.suppress(OSError):
                child.kill()  # our own helper process, never the job
