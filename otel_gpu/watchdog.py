"""Detection inside the agent: snapshot → points per subject → engine → breaker → actions.

Runs on the sampler thread after each sweep (never on the job's threads). Subjects:

* ``gpu:<uuid>`` — a device's memory, utilization, power, temperature, errors;
* ``process:<pid>@<uuid>`` — one process's memory on one GPU;
* ``rss:<pid>`` — a watched process's host RSS.

Their outputs carry the identity attributes of :mod:`otel_gpu.detect.subject`, the same ones
the processor gives the same subjects, so that a processor downstream recognises the subjects
this agent already watches (from ``otel_gpu.breaker.state``) and leaves them to it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.actions.config import ActionsConfig
from otel_gpu.actions.stop import start_ticks as read_start_ticks
from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import LEAK, Alert, Point
from otel_gpu.detect.subject import (
    GPU,
    PROCESS_GPU,
    PROCESS_RSS,
    SUBJECT_NAME,
    local_name,
    subject_attributes,
)
from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.watchdog")

BREAKER_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
_FORGET_AFTER_SWEEPS = 10  # a subject absent this long has gone (process exited, GPU removed)


def snapshot_points(
    snap: Snapshot,
    phase: str | None = None,
    step: float | None = None,
    host_memory: int | None = None,
) -> Iterator[tuple[str, Point, dict[str, Any]]]:
    """The detector inputs of one snapshot: (subject, point, attributes for the outputs)."""
    per_gpu: dict[str, int] = {}
    limits: dict[str, int | None] = {}
    for gp in snap.gpu_processes:
        per_gpu[gp.gpu_uuid] = per_gpu.get(gp.gpu_uuid, 0) + 1
    for g in snap.gpus:
        limits[g.uuid] = g.memory_total
        if g.status != "ok":
            continue
        yield (
            local_name(GPU, g.uuid, None),
            Point(
                time=snap.time,
                used_bytes=g.memory_used,
                limit_bytes=g.memory_total,
                util=g.util_gpu,
                # Unknown (not 0) when NVML could not list processes: 0 would read as "released".
                procs=per_gpu.get(g.uuid, 0) if g.processes_listed else None,
                phase=phase,
                power_w=g.power_w,
                power_limit_w=g.power_limit_w,
                step=step,
                temperature_c=g.temperature_c,
                ecc_uncorrected=g.ecc_uncorrected,
                xid_errors=g.xid_errors,
            ),
            dict(subject_attributes(GPU, g.uuid, None)),
        )
    for gp in snap.gpu_processes:
        if gp.used_memory is None:
            continue
        yield (
            local_name(PROCESS_GPU, gp.gpu_uuid, gp.pid),
            Point(
                time=snap.time,
                used_bytes=gp.used_memory,
                limit_bytes=limits.get(gp.gpu_uuid),
                phase=phase,
            ),
            dict(subject_attributes(PROCESS_GPU, gp.gpu_uuid, gp.pid)),
        )
    for p in snap.processes:
        if p.in_tree and p.memory_rss is not None:
            yield (
                local_name(PROCESS_RSS, None, p.pid),
                Point(
                    time=snap.time, used_bytes=p.memory_rss, limit_bytes=host_memory, phase=phase
                ),
                dict(subject_attributes(PROCESS_RSS, None, p.pid)),
            )


@dataclass(frozen=True)
class DetectionSettings:
    """The engine's, the breaker's and the actions' settings: resolved once, where a command
    (or the tracing pipeline) builds the agent, and handed to it ready."""

    detect: DetectConfig = field(default_factory=DetectConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> DetectionSettings:
        """``OTEL_GPU_DETECT_*``, ``OTEL_GPU_BREAKER_*`` and the action settings (default: this
        process's environment); UsageError on the first bad one, before anything starts."""
        env = os.environ if env is None else env
        return cls(
            DetectConfig.from_env(env), BreakerConfig.from_env(env), ActionsConfig.from_env(env)
        )


@dataclass(frozen=True)
class InProcessTrainer:
    """What an agent running inside the trainer's own process reads from it and asks of it.

    Built by the tracing side where it starts the agent (the detection side never imports
    tracing): cheap reads of Python variables for the phase and step, and the trainer's
    graceful checkpoint-and-stop request (True when a trainer takes it).
    """

    phase: Callable[[], str | None] = lambda: None
    step: Callable[[], float | None] = lambda: None
    request_stop: Callable[[str], bool] | None = None


class Watchdog:
    """Feeds the engine from snapshots and turns breaker transitions into actions."""

    def __init__(
        self,
        engine: Engine,
        breaker: Breaker,
        *,
        dispatcher: Any = None,
        phase: Callable[[], str | None] = lambda: None,
        step: Callable[[], float | None] = lambda: None,
        host_memory: int | None = None,
        start_ticks: Callable[[int], int | None] | None = None,
    ) -> None:
        self.engine = engine
        self.breaker = breaker
        self.dispatcher = dispatcher
        self._phase = phase
        self._step = step
        self._host_memory = host_memory
        self._lock = threading.Lock()  # guards the output tables read by OTel callbacks
        self._attrs: dict[str, dict[str, Any]] = {}
        # subject -> (rate, eta) of its active leak, re-read from the engine after each sweep
        self._leak: dict[str, tuple[float, float | None]] = {}
        self._leaking: set[str] = set()  # subjects that raised a leak alert (conditions to read)
        self._alert_counts: dict[tuple[str, str], int] = {}
        self._absent: dict[str, int] = {}
        self._states: dict[str, str] = {}  # breaker state per subject, copied for callbacks
        self.alerts: list[Alert] = []  # the latest alerts, bounded, for status displays
        # The job's trainer processes (the only ones a stop may signal): PID -> start ticks.
        self._trainers: dict[int, int | None] = {}
        # Reads a PID's start time (clock ticks) just before a stop; injected in tests.
        self._start_ticks = start_ticks or read_start_ticks
        self.alert_listeners: list[Callable[[Alert], None]] = []
        self.transition_listeners: list[Callable[[Transition], None]] = []
        # After each sweep's detection, on the sampler thread: the snapshot and the points the
        # engine judged, by subject (what a recording must hold to replay the same alerts).
        self.sweep_listeners: list[Callable[[Snapshot, list[tuple[str, Point]]], None]] = []

    @classmethod
    def build(
        cls,
        settings: DetectionSettings,
        *,
        proc_root: str = "/proc",
        trainer: InProcessTrainer | None = None,
        phase: Callable[[], str | None] | None = None,
    ) -> Watchdog:
        """Engine, breaker and actions from ready ``settings``.

        ``proc_root``: the /proc the sweeps read (``OTEL_GPU_PROC_ROOT``), where a stop reads
        the start times that guard against a reused PID; only the watched job's processes are
        ever signalled.
        ``trainer``: the agent runs inside this trainer, whose phase and step feed the
        detectors and whose graceful stop is asked first.
        ``phase``: where the current phase comes from when not from an in-process trainer (the
        sidecar's inference server: ``load`` while its KV cache fills).
        """
        import psutil

        from otel_gpu.actions.dispatcher import ActionDispatcher
        from otel_gpu.actions.stop import JobStopper

        trainer = trainer or InProcessTrainer()
        phase = phase if phase is not None else trainer.phase
        watchdog = cls(
            Engine(settings.detect),
            Breaker(settings.breaker),
            phase=phase,
            step=trainer.step,
            host_memory=psutil.virtual_memory().total,
            start_ticks=lambda pid: read_start_ticks(pid, proc_root),
        )
        stopper = JobStopper(watchdog.verified_trainers, request_fn=trainer.request_stop)
        watchdog.dispatcher = ActionDispatcher.from_config(settings.actions, stopper=stopper)
        return watchdog

    def on_snapshot(self, snap: Snapshot) -> None:
        self._update_trainers(snap)
        seen: set[str] = set()
        transitions: list[Transition] = []
        judged: list[tuple[str, Point]] = []
        for subject, point, attrs in snapshot_points(
            snap, self._phase(), self._step(), self._host_memory
        ):
            seen.add(subject)
            judged.append((subject, point))
            with self._lock:
                self._attrs[subject] = attrs
            for alert in self.engine.observe(subject, point):
                self._on_alert(alert)
                transitions.extend(self.breaker.record_alert(alert))
        self._forget_absent(seen)
        transitions.extend(self.breaker.advance_all(snap.time, self.engine.active_kinds))
        for t in transitions:
            self._on_transition(t)
        leaks = self._live_leaks()
        with self._lock:
            self._leak = leaks
            self._states = {s: self.breaker.state(s) for s in self._attrs}
        for listener in self.sweep_listeners:
            listener(snap, judged)

    def _live_leaks(self) -> dict[str, tuple[float, float | None]]:
        """The current rate and time to exhaustion of every active leak (a leak is only active
        after its alert, so only subjects that raised one are asked)."""
        out: dict[str, tuple[float, float | None]] = {}
        for subject in list(self._leaking):
            leak = [c for c in self.engine.conditions(subject) if c.kind == LEAK]
            if not leak or leak[0].rate_bytes_per_s is None:
                self._leaking.discard(subject)
                continue
            out[subject] = (leak[0].rate_bytes_per_s, leak[0].eta_s)
        return out

    def _update_trainers(self, snap: Snapshot) -> None:
        """Trainers = the watched processes that hold GPU memory; never a launcher above them
        (signalling `swift` or torchrun's agent orphans the ranks), never a process outside the
        watched tree. Without GPU processes (no GPU visible), none: nothing is signalled."""
        on_gpu = {snap.host_to_local.get(gp.pid, gp.pid) for gp in snap.gpu_processes}
        self._trainers = {
            p.pid: p.start_ticks for p in snap.processes if p.in_tree and p.pid in on_gpu
        }

    @property
    def trainer_pids(self) -> set[int]:
        return set(self._trainers)

    def verified_trainers(self) -> set[int]:
        """The trainers that are still the same processes now (start time re-read, exact to
        the clock tick), so a PID reused since the last sweep is never signalled. Called only
        when a stop fires."""
        return {
            pid
            for pid, started in list(self._trainers.items())
            if started is not None and self._start_ticks(pid) == started
        }

    def _on_alert(self, alert: Alert) -> None:
        with self._lock:
            key = (alert.subject, alert.kind)
            self._alert_counts[key] = self._alert_counts.get(key, 0) + 1
            self.alerts = [*self.alerts[-49:], alert]
        if alert.kind == LEAK:
            self._leaking.add(alert.subject)
        for listener in self.alert_listeners:
            listener(alert)

    def _on_transition(self, t: Transition) -> None:
        if self.dispatcher is not None:
            self.dispatcher.on_transition(t)
        for listener in self.transition_listeners:
            listener(t)

    def _forget_absent(self, seen: set[str]) -> None:
        for subject in seen:
            self._absent.pop(subject, None)
        with self._lock:
            known = list(self._attrs)
        for subject in known:
            if subject in seen:
                continue
            n = self._absent.get(subject, 0) + 1
            self._absent[subject] = n
            if n >= _FORGET_AFTER_SWEEPS:
                self.engine.forget(subject)
                self.breaker.forget(subject)
                self._absent.pop(subject, None)
                self._leaking.discard(subject)
                with self._lock:
                    self._attrs.pop(subject, None)
                    self._leak.pop(subject, None)
                    for key in [k for k in self._alert_counts if k[0] == subject]:
                        del self._alert_counts[key]

    # -- detector outputs as instruments ------------------------------------------------------

    def register_instruments(self, meter: Meter) -> None:
        meter.create_observable_gauge(
            "otel_gpu.leak.rate",
            callbacks=[self._observe_leak_rate],
            unit="By/s",
            description="Memory growth rate of a subject with an active leak alert",
        )
        meter.create_observable_gauge(
            "otel_gpu.memory.time_to_exhaustion",
            callbacks=[self._observe_eta],
            unit="s",
            description="Projected time until a leaking subject reaches its memory limit",
        )
        meter.create_observable_gauge(
            "otel_gpu.breaker.state",
            callbacks=[self._observe_breaker],
            unit="1",
            description="Circuit breaker per subject: 0 closed, 1 half-open, 2 open",
        )
        meter.create_observable_counter(
            "otel_gpu.alerts",
            callbacks=[self._observe_alerts],
            unit="{alert}",
            description="Alerts raised, by subject and kind",
        )

    def _observe_leak_rate(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [Observation(rate, self._attrs_of(s)) for s, (rate, _eta) in self._leak.items()]

    def _observe_eta(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [
                Observation(eta, self._attrs_of(s))
                for s, (_rate, eta) in self._leak.items()
                if eta is not None
            ]

    def _observe_breaker(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [
                Observation(BREAKER_CODES.get(state, 0), self._attrs_of(s))
                for s, state in self._states.items()
            ]

    def _observe_alerts(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [
                Observation(n, self._attrs_of(s) | {"otel_gpu.alert.kind": k})
                for (s, k), n in self._alert_counts.items()
            ]

    def _attrs_of(self, subject: str) -> dict[str, Any]:
        """A subject's identity attributes (under the lock)."""
        return self._attrs.get(subject) or {SUBJECT_NAME: subject}

    def close(self, timeout_s: float = 5.0) -> None:
        if self.dispatcher is not None:
            self.dispatcher.close(timeout_s)
