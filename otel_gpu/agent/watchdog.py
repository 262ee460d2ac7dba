"""Detection inside the agent: snapshot → points per subject → engine → breaker → actions.

Runs on the sampler thread after each sweep (never on the job's threads). The subjects and
their points come from :mod:`otel_gpu.agent.points`; the stop action may signal only the job's
trainers (:mod:`otel_gpu.actions.trainers`).

Their outputs carry the identity attributes of :mod:`otel_gpu.detect.subject`, the same ones
the processor gives the same subjects, so that a processor downstream recognises the subjects
this agent already watches (from ``otel_gpu.breaker.state``) and leaves them to it.
"""

from __future__ import annotations

import dataclasses
import itertools
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
from otel_gpu.agent.memory_diagnosis import MemoryAttribution
from otel_gpu.agent.points import snapshot_points
from otel_gpu.core.signals import (
    ALERT_KIND,
    ALERTS,
    BREAKER_STATE,
    DETECTOR_OUTPUTS,
    JOB,
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
from otel_gpu.detect.lost import GpuSeen, GpuUser, LostGpus
from otel_gpu.detect.model import LEAK, Alert, Point
from otel_gpu.detect.subject import SUBJECT_NAME, local_name, subject_attributes
from otel_gpu.sampling.snapshot import STATUS_FAILED, Snapshot

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
    # cursor -> (new cursor, [(cursor, step, loss, grad norm), ...]): the numbers logged per
    # step since the cursor (tracing/progress.numbers_since), for the numerics detector
    numbers: (
        Callable[[int], tuple[int, list[tuple[int, int, float | None, float | None]]]] | None
    ) = None
    # the process whose host memory carries the steps in a sweep without GPUs (this one)
    pid: Callable[[], int | None] = os.getpid


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
        step_pid: Callable[[], int | None] = lambda: None,
        host_memory: int | None = None,
        start_ticks: Callable[[int], int | None] | None = None,
        proc_root: str = "/proc",
        numbers: Callable[[int], tuple[int, list[tuple[int, int, float | None, float | None]]]]
        | None = None,
    ) -> None:
        self.engine = engine
        self.breaker = breaker
        self.dispatcher = dispatcher
        self._phase = phase
        self._step = step
        self._step_pid = step_pid
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
        # GPUs that fall off (device count drop, UUID gone, GPU_IS_LOST): job-level alerts
        self._lost = LostGpus()
        self._proc_root = proc_root
        self._ranks: dict[int, int | None] = {}  # pid -> RANK from its environment, read once
        # the trainer's loss and gradient norm per step (in-process only): subject job:<pid>
        self._numbers = numbers
        self._numbers_seq = 0
        self._numbers_live = False
        self._job = local_name(JOB, None, os.getpid())

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
            step_pid=trainer.pid,
            numbers=trainer.numbers,
            host_memory=psutil.virtual_memory().total,
            start_ticks=lambda pid: read_start_ticks(pid, proc_root),
            proc_root=proc_root,
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
        watchdog.attribute_leaks()
        return watchdog

    def diagnosis_queue(self) -> DiagnosisQueue:
        """The watchdog's one diagnosis queue (made on first use); each concern registers its
        alert kinds on it."""
        if self.diagnosis is None:
            self.diagnosis = DiagnosisQueue({})
        return self.diagnosis

    def attribute_leaks(self, attribution: MemoryAttribution | None = None) -> None:
        """Leak alerts wait (bounded) for the holders their process's census names; a
        suspicion asks that process for its baseline census (agent/memory_diagnosis.py)."""
        attribution = attribution or MemoryAttribution()
        attribution.attach(self.diagnosis_queue())
        self.sweep_listeners.append(lambda _snap, judged: attribution.on_sweep(self.engine, judged))

    def on_snapshot(self, snap: Snapshot) -> None:
        self._trainers.update(snap)
        seen: set[str] = set()
        transitions: list[Transition] = []
        judged: list[tuple[str, Point]] = []
        points = snapshot_points(
            snap, self._phase(), self._step(), self._host_memory, self._step_pid()
        )
        for subject, point, attrs in itertools.chain(points, self._numbers_points(snap)):
            seen.add(subject)
            judged.append((subject, point))
            with self._lock:
                self._attrs[subject] = attrs
            for found in self.engine.observe(subject, point):
                alert = self._annotated(found, snap)
                caused = self.breaker.record_alert(alert)
                if alert.kind == LEAK:  # its rate is exported now, diagnosed or not (data)
                    self._leaking.add(alert.subject)
                if self.diagnosis is not None and self.diagnosis.takes(alert):
                    self.diagnosis.submit(alert, caused)
                    continue
                self._on_alert(alert)
                transitions.extend(caused)
        for alert in self._lost_gpus(snap):
            transitions.extend(self.breaker.record_alert(alert))
            self._on_alert(alert)
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

    def _numbers_points(self, snap: Snapshot) -> Iterator[tuple[str, Point, dict[str, Any]]]:
        """The trainer's loss and gradient norm of each step logged since the last sweep, as
        points of the job's subject (one per step: the detector counts steps, not sweeps)."""
        if self._numbers is None:
            return
        self._numbers_seq, found = self._numbers(self._numbers_seq)
        if not found and not self._numbers_live:
            return
        self._numbers_live = True  # from now on seen every sweep, so its state is kept
        attrs = dict(subject_attributes(JOB, None, os.getpid()))
        phase = self._phase()
        if not found:
            yield self._job, Point(snap.time, phase=phase), attrs
        for _seq, step, loss, grad in found:
            yield (
                self._job,
                Point(snap.time, step=step, loss=loss, grad_norm=grad, phase=phase),
                attrs,
            )

    def _users(self, snap: Snapshot) -> dict[str, list[GpuUser]]:
        """The processes on each GPU this sweep, with their ranks where their environment
        names one (read once per PID, on the sampler thread)."""
        names = {p.pid: p.executable_name for p in snap.processes}
        out: dict[str, list[GpuUser]] = {}
        for gp in snap.gpu_processes:
            pid = snap.host_to_local.get(gp.pid, gp.pid)
            if pid not in self._ranks:
                if len(self._ranks) > 4096:
                    self._ranks.clear()
                self._ranks[pid] = read_rank(pid, self._proc_root)
            out.setdefault(gp.gpu_uuid, []).append(GpuUser(pid, self._ranks[pid], names.get(pid)))
        return out

    def _lost_gpus(self, snap: Snapshot) -> list[Alert]:
        seen = [
            GpuSeen(g.uuid, g.index, g.status == STATUS_FAILED, g.xid_last)
            for g in snap.gpus
            if g.parent is None
        ]
        answers = snap.no_gpu_reason is None or snap.no_gpu_reason == "NVML reports no GPU"
        return self._lost.observe(snap.time, seen, self._users(snap), nvml_answers=answers)

    def _annotated(self, alert: Alert, snap: Snapshot) -> Alert:
        """An application's Xid names the processes it belongs to (those on that GPU)."""
        if alert.evidence.get("xid_class") != "application" or not alert.subject.startswith("gpu:"):
            return alert
        users = self._users(snap).get(alert.subject[len("gpu:") :], [])
        if not users:
            return alert
        evidence = {**alert.evidence, "pids": ",".join(str(u.pid) for u in users)}
        who = ", ".join(str(u) for u in users[:8])
        return dataclasses.replace(
            alert, message=f"{alert.message} (processes on it: {who})", evidence=evidence
        )

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


def read_rank(pid: int, proc_root: str = "/proc") -> int | None:
    """``RANK`` from a process's environment (torchrun, SLURM via ``SLURM_PROCID``), or None
    where it names none or cannot be read (another user's process)."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            raw = f.read(256 * 1024)
    except OSError:
        return None
    found: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key in (b"RANK", b"SLURM_PROCID"):
            found[key] = value
    for key in (b"RANK", b"SLURM_PROCID"):
        if key in found and found[key].isdigit() and len(found[key]) < 9:
            return int(found[key])
    return None
