"""Detection inside the agent: snapshot → points per subject → engine → breaker → actions.

Runs on the sampler thread after each sweep (never on the job's threads). The subjects and
their points come from :mod:`otel_gpu.agent.points`; the stop action may signal only the job's
trainers (:mod:`otel_gpu.actions.trainers`).

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

from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.actions.stop import start_ticks as read_start_ticks
from otel_gpu.actions.trainers import Trainers
from otel_gpu.agent.diagnosis import DiagnosisQueue
from otel_gpu.agent.points import snapshot_points
from otel_gpu.core.signals import (
    ALERT_KIND,
    ALERTS,
    BREAKER_STATE,
    DETECTOR_OUTPUTS,
    LEAK_RATE,
    TIME_TO_EXHAUSTION,
    Signal,
    observable,
)
from otel_gpu.detect.breaker import (
    CLOSED,
    OPEN,
    STATE_VALUES,
    Breaker,
    BreakerConfig,
    Transition,
)
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import LEAK, Alert, Point
from otel_gpu.detect.subject import SUBJECT_NAME
from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.watchdog")

_Output = tuple[float, str, dict[str, str]]  # (value, subject, extra point attributes)

_FORGET_AFTER_SWEEPS = 10  # a subject absent this long has gone (process exited, GPU removed)


@dataclass(frozen=True)
class DetectionSettings:
    """The engine's, the breaker's and the actions' settings: resolved once, where a command
    (or the tracing pipeline) builds the agent, and handed to it ready."""

    detect: DetectConfig = field(default_factory=DetectConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    service: str = ""  # the job's service.name, named in notifications

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> DetectionSettings:
        """``OTEL_GPU_DETECT_*``, ``OTEL_GPU_BREAKER_*`` and the action settings (default: this
        process's environment); UsageError on the first bad one, before anything starts."""
        from otel_gpu.core.job_identity import given_service_name

        env = os.environ if env is None else env
        return cls(
            DetectConfig.from_env(env),
            BreakerConfig.from_env(env),
            ActionsConfig.from_env(env),
            given_service_name(env) or "",
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
        # The job's trainer processes (the only ones a stop may signal); the start time of a
        # PID is read just before a stop (injected in tests).
        self._trainers = Trainers(start_ticks or read_start_ticks)
        # GPUs whose open breaker is context of a process's problem: no notification of their own.
        self._quiet_gpus: set[str] = set()
        self.alert_listeners: list[Callable[[Alert], None]] = []
        self.transition_listeners: list[Callable[[Transition], None]] = []
        # After each sweep's detection, on the sampler thread: the snapshot and the points the
        # engine judged, by subject (what a recording must hold to replay the same alerts).
        self.sweep_listeners: list[Callable[[Snapshot, list[tuple[str, Point]]], None]] = []
        # Alerts of the kinds a diagnoser is registered for wait here (with the transitions of
        # their subject) until their diagnosis is attached; see agent/diagnosis.py.
        self.diagnosis: DiagnosisQueue | None = None

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
        stopper = JobStopper(
            watchdog.verified_trainers,
            request_fn=trainer.request_stop,
            not_the_jobs=watchdog.not_the_jobs,
        )
        watchdog.dispatcher = ActionDispatcher.from_config(
            settings.actions,
            stopper=stopper,
            source=f"job {settings.service}" if settings.service else "",
        )
        return watchdog

    def on_snapshot(self, snap: Snapshot) -> None:
        self._trainers.update(snap)
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
                caused = self.breaker.record_alert(alert)
                if self.diagnosis is not None and self.diagnosis.takes(alert):
                    self.diagnosis.submit(alert, caused)
                    continue
                self._on_alert(alert)
                transitions.extend(caused)
        self._forget_absent(seen)
        transitions.extend(self.breaker.advance_all(snap.time, self.engine.active_kinds))
        for t in transitions:
            if self.diagnosis is None or not self.diagnosis.hold(t):
                self._on_transition(t)
        self._release_diagnosed()
        leaks = self._live_leaks()
        with self._lock:
            self._leak = leaks
            self._states = {s: self.breaker.state(s) for s in self._attrs}
        for listener in self.sweep_listeners:
            listener(snap, judged)

    def judging(self) -> bool:
        """Whether a leak or stall is suspected or confirmed now: a subject with an active
        condition or whose breaker is not closed (after the last sweep). Cheap each sweep:
        conditions are only asked of subjects that raised an alert."""
        with self._lock:
            if any(state != CLOSED for state in self._states.values()):
                return True
            alerted = {subject for subject, _kind in self._alert_counts}
        return any(self.engine.active_kinds(s) for s in alerted)

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

    @property
    def trainer_pids(self) -> set[int]:
        return self._trainers.pids

    def verified_trainers(self) -> set[int]:
        """The trainers that are still the same processes now, so a PID reused since the last
        sweep is never signalled. Called only when a stop fires."""
        return self._trainers.verified()

    def not_the_jobs(self, alert: Alert) -> str | None:
        """Why ``alert`` is not the job's own problem, so a stop must not fire (a leak on a GPU
        whose growth is another tenant's); None when it is. On the sampler thread."""

        def leaking(subject: str) -> bool:
            return any(c.kind == LEAK for c in self.engine.conditions(subject))

        return self._trainers.not_the_jobs(alert, leaking)

    def _release_diagnosed(self, force: bool = False) -> None:
        if self.diagnosis is None:
            return
        for alert, transitions in self.diagnosis.release(force=force):
            self._on_alert(alert)
            for t in transitions:
                self._on_transition(t)

    def _context_only(self, t: Transition) -> bool:
        """Whether ``t`` is a GPU's transition while a process on that GPU has its breaker
        open: one problem, one notification — the process's (the cause; its GPU is named in
        it); the GPU's opening and its later resolution are logged only."""
        if not t.subject.startswith("gpu:"):
            return False
        if t.to_state == OPEN:
            suffix = "@" + t.subject.partition(":")[2]
            with self._lock:
                subjects = list(self._attrs)
            cause = any(
                s.startswith("process:") and s.endswith(suffix) and self.breaker.state(s) == OPEN
                for s in subjects
            )
            if cause:
                self._quiet_gpus.add(t.subject)
            return cause
        if t.subject in self._quiet_gpus:
            if t.to_state == CLOSED:
                self._quiet_gpus.discard(t.subject)
            return True
        return False

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
            if self._context_only(t):
                self.dispatcher.on_transition(t, notify=False)
            else:
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
        """The detector outputs (signals.DETECTOR_OUTPUTS), read from the last sweep's tables."""
        readers: dict[Signal, Callable[[], Iterator[_Output]]] = {
            LEAK_RATE: self._leak_rates,
            TIME_TO_EXHAUSTION: self._etas,
            BREAKER_STATE: self._breaker_states,
            ALERTS: self._alert_totals,
        }
        for signal in DETECTOR_OUTPUTS:
            observable(meter, signal, [self._callback(readers[signal])])

    def _callback(
        self, read: Callable[[], Iterator[_Output]]
    ) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(_options: CallbackOptions) -> list[Observation]:
            with self._lock:
                return [Observation(v, self._attrs_of(s) | extra) for v, s, extra in read()]

        return callback

    def _leak_rates(self) -> Iterator[_Output]:
        for subject, (rate, _eta) in self._leak.items():
            yield rate, subject, {}

    def _etas(self) -> Iterator[_Output]:
        for subject, (_rate, eta) in self._leak.items():
            if eta is not None:
                yield eta, subject, {}

    def _breaker_states(self) -> Iterator[_Output]:
        for subject, state in self._states.items():
            yield STATE_VALUES.get(state, 0), subject, {}

    def _alert_totals(self) -> Iterator[_Output]:
        for (subject, kind), n in self._alert_counts.items():
            yield n, subject, {ALERT_KIND: kind}

    def _attrs_of(self, subject: str) -> dict[str, Any]:
        """A subject's identity attributes (under the lock)."""
        return self._attrs.get(subject) or {SUBJECT_NAME: subject}

    def close(self, timeout_s: float = 5.0) -> None:
        """Release every held alert (with what its diagnosis found by now), then flush the
        actions within ``timeout_s``."""
        if self.diagnosis is not None:
            self._release_diagnosed(force=True)
            self.diagnosis.close()
        if self.dispatcher is not None:
            self.dispatcher.close(timeout_s)
