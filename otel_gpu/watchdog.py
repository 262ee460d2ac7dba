"""Detection inside the agent: snapshot → points per subject → engine → breaker → actions.

Runs on the sampler thread after each sweep (never on the job's threads). Subjects:

* ``gpu:<uuid>`` — a device's memory, utilization, power, temperature, errors;
* ``process:<pid>@<uuid>`` — one process's memory on one GPU;
* ``rss:<pid>`` — a watched process's host RSS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import Alert, Point
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
            f"gpu:{g.uuid}",
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
            {"hw.id": g.uuid},
        )
    for gp in snap.gpu_processes:
        if gp.used_memory is None:
            continue
        yield (
            f"process:{gp.pid}@{gp.gpu_uuid}",
            Point(
                time=snap.time,
                used_bytes=gp.used_memory,
                limit_bytes=limits.get(gp.gpu_uuid),
                phase=phase,
            ),
            {"process.pid": gp.pid, "hw.id": gp.gpu_uuid},
        )
    for p in snap.processes:
        if p.in_tree and p.memory_rss is not None:
            yield (
                f"rss:{p.pid}",
                Point(
                    time=snap.time, used_bytes=p.memory_rss, limit_bytes=host_memory, phase=phase
                ),
                {"process.pid": p.pid},
            )


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
    ) -> None:
        self.engine = engine
        self.breaker = breaker
        self.dispatcher = dispatcher
        self._phase = phase
        self._step = step
        self._host_memory = host_memory
        self._lock = threading.Lock()  # guards the output tables read by OTel callbacks
        self._attrs: dict[str, dict[str, Any]] = {}
        self._leak: dict[str, tuple[float, float | None]] = {}  # subject -> (rate, eta)
        self._alert_counts: dict[tuple[str, str], int] = {}
        self._absent: dict[str, int] = {}
        self._states: dict[str, str] = {}  # breaker state per subject, copied for callbacks
        self.alerts: list[Alert] = []  # the latest alerts, bounded, for status displays
        # The job's trainer processes (the only ones a stop may signal): PID -> start time.
        self._trainers: dict[int, float | None] = {}
        self.alert_listeners: list[Callable[[Alert], None]] = []
        self.transition_listeners: list[Callable[[Transition], None]] = []

    @classmethod
    def from_env(
        cls,
        tree: Any = None,
        *,
        in_process: bool = False,
        phase: Callable[[], str | None] | None = None,
    ) -> Watchdog:
        """Engine, breaker and actions configured from ``OTEL_GPU_*`` variables.

        ``tree`` bounds the stop action: only the watched job's processes are ever signalled.
        ``in_process``: the agent runs inside the trainer, whose graceful stop is asked first.
        ``phase``: where the current phase comes from when not from an in-process trainer (the
        sidecar's inference server: ``load`` while its KV cache fills).
        """
        import psutil

        from otel_gpu.actions.config import ActionsConfig
        from otel_gpu.actions.dispatcher import ActionDispatcher
        from otel_gpu.actions.stop import JobStopper

        trainer_phase, step = _in_process_progress()
        phase = phase if phase is not None else trainer_phase
        watchdog = cls(
            Engine(DetectConfig.from_env()),
            Breaker(BreakerConfig.from_env()),
            phase=phase,
            step=step,
            host_memory=psutil.virtual_memory().total,
        )
        stopper = JobStopper(
            watchdog.verified_trainers, request_fn=_graceful_stop() if in_process else None
        )
        watchdog.dispatcher = ActionDispatcher.from_config(
            ActionsConfig.from_env(), stopper=stopper
        )
        return watchdog

    def on_snapshot(self, snap: Snapshot) -> None:
        self._update_trainers(snap)
        seen: set[str] = set()
        transitions: list[Transition] = []
        for subject, point, attrs in snapshot_points(
            snap, self._phase(), self._step(), self._host_memory
        ):
            seen.add(subject)
            with self._lock:
                self._attrs[subject] = attrs
            for alert in self.engine.observe(subject, point):
                self._on_alert(alert)
                transitions.extend(self.breaker.record_alert(alert))
        self._forget_absent(seen)
        transitions.extend(self.breaker.advance_all(snap.time))
        for t in transitions:
            self._on_transition(t)
        with self._lock:
            self._states = {s: self.breaker.state(s) for s in self._attrs}

    def _update_trainers(self, snap: Snapshot) -> None:
        """Trainers = the watched processes that hold GPU memory; never a launcher above them
        (signalling `swift` or torchrun's agent orphans the ranks), never a process outside the
        watched tree. Without GPU processes (no GPU visible), none: nothing is signalled."""
        on_gpu = {snap.host_to_local.get(gp.pid, gp.pid) for gp in snap.gpu_processes}
        self._trainers = {
            p.pid: p.create_time for p in snap.processes if p.in_tree and p.pid in on_gpu
        }

    @property
    def trainer_pids(self) -> set[int]:
        return set(self._trainers)

    def verified_trainers(self) -> set[int]:
        """The trainers that are still the same processes now (start time re-read), so a PID
        reused since the last sweep is never signalled. Called only when a stop fires."""
        import psutil

        alive = set()
        for pid, started in list(self._trainers.items()):
            try:
                now_started = psutil.Process(pid).create_time()
            except psutil.Error:
                continue
            if started is not None and abs(now_started - started) < 1.0:
                alive.add(pid)
        return alive

    def _on_alert(self, alert: Alert) -> None:
        with self._lock:
            key = (alert.subject, alert.kind)
            self._alert_counts[key] = self._alert_counts.get(key, 0) + 1
            if alert.kind == "leak" and alert.rate_bytes_per_s is not None:
                self._leak[alert.subject] = (alert.rate_bytes_per_s, alert.eta_s)
            self.alerts = [*self.alerts[-49:], alert]
        for listener in self.alert_listeners:
            listener(alert)

    def _on_transition(self, t: Transition) -> None:
        if self.dispatcher is not None:
            self.dispatcher.on_transition(t)
        if t.to_state == CLOSED:
            with self._lock:
                self._leak.pop(t.subject, None)
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
            return [
                Observation(
                    rate, self._attrs.get(s, {"otel_gpu.subject": s}) | {"otel_gpu.subject": s}
                )
                for s, (rate, _eta) in self._leak.items()
            ]

    def _observe_eta(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [
                Observation(eta, self._attrs.get(s, {}) | {"otel_gpu.subject": s})
                for s, (_rate, eta) in self._leak.items()
                if eta is not None
            ]

    def _observe_breaker(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [
                Observation(
                    BREAKER_CODES.get(state, 0), self._attrs.get(s, {}) | {"otel_gpu.subject": s}
                )
                for s, state in self._states.items()
            ]

    def _observe_alerts(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            return [
                Observation(
                    n, self._attrs.get(s, {}) | {"otel_gpu.subject": s, "otel_gpu.alert.kind": k}
                )
                for (s, k), n in self._alert_counts.items()
            ]

    def close(self, timeout_s: float = 5.0) -> None:
        if self.dispatcher is not None:
            self.dispatcher.close(timeout_s)


def _in_process_progress() -> tuple[Callable[[], str | None], Callable[[], float | None]]:
    """Phase and step of an in-process trainer, when the tracing side knows them."""
    try:
        from otel_gpu.tracing import current_phase, current_step
    except ImportError:
        return (lambda: None), (lambda: None)
    return current_phase, current_step


def check_settings() -> None:
    """Validate the detection, breaker and action settings now (UsageError on a bad one), so a
    command can refuse before it starts the job rather than run it unwatched."""
    from otel_gpu.actions.config import ActionsConfig

    DetectConfig.from_env()
    BreakerConfig.from_env()
    ActionsConfig.from_env()


def _graceful_stop() -> Callable[[str], bool] | None:
    """The in-process trainer's checkpoint-and-stop request, when the tracing side has one."""
    try:
        from otel_gpu.tracing.control import request_stop
    except ImportError:
        return None
    return request_stop
