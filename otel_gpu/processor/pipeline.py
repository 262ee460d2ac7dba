"""Detection inside the processor: decoded series -> Engine -> Breaker -> store, actions, outputs.

One lock serializes the pipeline (the engine and breaker are not thread-safe, and with the GIL
there is nothing to gain from finer locks). Per request the order is: decode, assemble, detect;
then, if anything happened, queue alerts and transitions for the store and the alert log
records for downstream. The store's writer thread fires the actions once the batch is written
(never on the ingestion path): a notification never goes out before it is durable.
The breaker runs on each subject's data time and on the engine's active conditions, so it
closes only once the problem stopped; a subject that stops sending keeps its state. Subjects an
agent already judges (it exports their ``otel_gpu.breaker.state``, see watched.py) are left to
that agent: one problem, one notification.

Stragglers (processor/stragglers.py) are judged per job beside the engine, from the ranks'
work per step; their alerts join the engine's here, on the same path.

Two clocks: judgement is on data time (each point's timestamp), housekeeping (the assembly
grace, forgetting silent subjects, the detector-metrics cadence) on the injected monotonic
``clock``, so a wall-clock step neither evicts every subject nor holds points back. The wall
clock only bounds how far in the future a timestamp may be and stamps the outputs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from otel_gpu.detect.breaker import STATE_VALUES, Breaker, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import LEAK, Alert, Point
from otel_gpu.processor import outputs
from otel_gpu.processor.assemble import Assembler, Subject
from otel_gpu.processor.decode import DEVICE, Decoded, MetricsDecoder
from otel_gpu.processor.settings import ProcessorConfig
from otel_gpu.processor.store import Batch, StateStore
from otel_gpu.processor.stragglers import Stragglers, straggler_config
from otel_gpu.processor.watched import WatchedSubjects
from otel_gpu.processor.wire import LOGS_EXPORT, METRICS_EXPORT

log = logging.getLogger("otel_gpu.processor")

_CAP_RECENT_S = 60.0  # /healthz is degraded this long after the subject cap refused one


class Actions(Protocol):
    def on_transition(self, t: Transition) -> None: ...


@dataclass
class DetectionStats:
    """Counters since start (a snapshot)."""

    points: int = 0  # routed points accepted
    rejected: int = 0  # routed points rejected (NaN, inf, bad timestamps, start after time)
    ignored: int = 0  # routed points forwarded but not judged (see decode.py)
    late: int = 0  # points older than their subject's latest
    overflow: int = 0  # points refused because --max-series subjects are tracked
    subjects: int = 0  # subjects tracked now
    evaluated: int = 0  # Points the engine judged
    alerts: int = 0
    transitions: int = 0
    errors: int = 0  # points the engine failed on (logged, skipped)
    agent_watched: int = 0  # subjects left to the agent that reports them (it judges them)
    cap_refused: int = 0  # new subjects refused because --max-series subjects were tracked
    peer_refused: int = 0  # new subjects refused by a peer's --max-series-per-peer quota
    vouch_refused: int = 0  # breaker points of a reporter identity another peer owns
    straggler_jobs: int = 0  # jobs whose ranks are judged for a straggler now
    straggler_ranks: int = 0  # ranks judged now (over all jobs)
    straggler_refused: int = 0  # ranks refused by --max-series / --max-series-per-peer


def _output(s: Subject) -> outputs.SubjectOutput:
    return outputs.SubjectOutput(tuple(s.resource.attrs), tuple(s.attrs))


def _output_from(detail: dict[str, Any]) -> outputs.SubjectOutput:
    return outputs.SubjectOutput(
        tuple((str(k), v) for k, v in detail.get("resource", [])),
        tuple((str(k), v) for k, v in detail.get("attrs", [])),
    )


class Detection:
    """The processor's detection pipeline. Thread-safe."""

    def __init__(
        self,
        config: ProcessorConfig,
        engine: Engine,
        breaker: Breaker,
        store: StateStore,
        actions: Actions | None,
        send: Callable[[str, bytes], None],
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine = engine
        self.breaker = breaker
        self._store = store
        self._actions = actions
        self._send = send
        self._wall = wall
        self._clock = clock
        self._lock = threading.Lock()
        self._decoder = MetricsDecoder(config.min_time_unix_s, config.max_future_s)
        self._assembler = Assembler(
            self._on_point,
            config.max_series,
            config.assemble_grace_s,
            config.series_ttl_s,
            per_reporter=config.max_series_per_reporter,
            per_peer=config.max_series_per_peer,
        )
        self._owners = self._assembler.owners  # reporter label -> peer: bound once, shared
        self._stragglers: Stragglers | None = None
        if engine.config.straggler_enabled:
            self._stragglers = Stragglers(
                straggler_config(engine.config),
                config.max_series,
                config.max_series_per_peer,
                config.max_series,
                config.series_ttl_s,
            )
            self._assembler.stragglers = self._stragglers
        self._cap_full_at: float | None = None  # monotonic time --max-series last refused one
        self._cap_warned = False  # logged in this episode (until the cap has room again)
        self._quota_warned: set[str] = set()  # peers logged at their quota (bounded)
        self._start_ns = int(wall() * 1e9)
        self._last_export = self._last_evict = clock()
        store.on_durable = self._act
        self._stats = DetectionStats()
        # Per-request event buffers, drained by _publish under the lock.
        self._alerts: list[tuple[Subject, Alert]] = []
        self._transitions: list[tuple[Subject | None, Transition]] = []
        # Outputs of subjects that alerted (restored from the store after a restart).
        self._outputs: dict[str, outputs.SubjectOutput] = {
            name: _output_from(d) for name, d in store.load_subjects().items()
        }
        self._alert_counts: dict[tuple[str, str], int] = store.alert_counts()
        self._watched = WatchedSubjects(config.max_series, config.series_ttl_s)
        self._agent_subjects = self._watched.seen  # checked on every point
        self._active_kinds = engine.active_kinds  # bound once: passed on every point
        # The engine's evidence does not survive a restart, but a restored breaker may have been
        # held open by an active condition. It stays held until the engine has had the data
        # time to judge that condition again (a persisting leak or stall is re-alerted within
        # it), so a restart never reads as "resolved". subject -> (kinds, first data time).
        cfg = engine.config
        self._rejudge_s = max(3 * cfg.leak_min_window_s, 2 * cfg.stall_window_max_s)
        self._restored: dict[str, tuple[frozenset[str], float | None]] = {
            name: (frozenset(d.get("held", ())), None)
            for name, d in breaker.export_state().get("subjects", {}).items()
            if d.get("state") != "closed" and d.get("held") and d.get("clear_since", 0) is None
        }

    # -- ingestion ---------------------------------------------------------------------------

    def ingest_metrics(self, raw: bytes, peer: str = "") -> Decoded:
        """Decode, assemble and judge one OTLP metrics request from ``peer`` (the client's
        address; quotas and ownership are keyed on it). DecodeError if malformed."""
        wall, now = self._wall(), self._clock()
        with self._lock:
            a = self._assembler
            a.now, a.peer = now, peer
            for name in self._watched.note(raw, now, peer, self._owners):
                self.engine.forget(name)  # its agent judges it; evidence here would go stale
            overflow, cap, quota = a.overflow, a.cap_refused, a.peer_refused
            try:
                decoded = self._decoder.decode(raw, a, int(wall * 1e9))
                a.flush_due(now)
            finally:
                self._publish(wall)
            decoded.overflow = a.overflow - overflow
            if a.cap_refused > cap:
                self._cap_full_at = now
                if not self._cap_warned:  # once per episode: until the cap has room again
                    self._cap_warned = True
                    log.warning(
                        "the subject cap is full (--max-series %d): new GPUs and processes "
                        "are not judged until subjects are forgotten; counted in /stats "
                        "detection.cap_refused",
                        self.config.max_series,
                    )
            if a.peer_refused > quota and peer not in self._quota_warned:
                if len(self._quota_warned) < 1024:
                    self._quota_warned.add(peer)
                log.warning(
                    "peer %s holds its quota of %d detection subjects (--max-series-per-peer), "
                    "whatever reporter identities it claims: its further new subjects are not "
                    "judged (counted in /stats detection.peer_refused)",
                    peer or "(local)",
                    self.config.max_series_per_peer,
                )
            self._stats.points += decoded.points
            self._stats.rejected += decoded.rejected
            self._stats.ignored += decoded.ignored
        return decoded

    def tick(self, now: float | None = None, final: bool = False) -> None:
        """Periodic work: emit points pending past the grace time (all of them if ``final``),
        forget silent subjects, and export detector metrics every export interval. ``now`` is
        the monotonic clock's reading."""
        now = self._clock() if now is None else now
        wall = self._wall()
        with self._lock:
            self._assembler.now = now
            self._assembler.flush_due(now, all_pending=final)
            if now - self._last_evict >= min(self.config.series_ttl_s / 10, 30.0):
                self._last_evict = now
                for subject in self._assembler.evict(now):
                    self.engine.forget(subject.name)
                if self._stragglers is not None:
                    self._stragglers.evict(now)
                self._watched.expire(now)
                if len(self._assembler) < self.config.max_series:
                    self._cap_warned = False
                self._quota_warned.intersection_update(self._assembler.peers_at_quota)
            self._publish(wall)
            if final or now - self._last_export >= self.config.export_interval_s:
                self._last_export = now
                self._export_metrics(wall)

    def stats(self) -> DetectionStats:
        with self._lock:
            a = self._assembler
            s = DetectionStats(**vars(self._stats))
            s.late, s.overflow, s.subjects = a.late, a.overflow, len(a)
            s.cap_refused, s.peer_refused = a.cap_refused, a.peer_refused
            s.agent_watched = len(self._watched)
            s.vouch_refused = self._watched.refused
            st = self._stragglers
            if st is not None:
                s.straggler_jobs, s.straggler_ranks, s.straggler_refused = (
                    st.jobs,
                    st.ranks,
                    st.refused,
                )
            return s

    def problem(self) -> str | None:
        """Why health is degraded by detection: the subject cap refused a subject lately."""
        with self._lock:
            at = self._cap_full_at
            if at is None or self._clock() - at > _CAP_RECENT_S:
                return None
            return (
                f"the subject cap is full (--max-series {self.config.max_series}): new GPUs "
                f"and processes are not judged ({self._assembler.cap_refused} refused)"
            )

    # -- detection ---------------------------------------------------------------------------

    def _on_point(self, subject: Subject, point: Point) -> None:
        name = subject.name
        if subject.kind == DEVICE and self._stragglers is not None and subject.hw_id:
            # what a straggler alert quotes of the GPU (whoever judges it)
            self._stragglers.gpu_point(subject.hw_id, point, self._assembler.now)
        vouched = self._agent_subjects.get(name)
        # Left to an agent only on the word of the peer that owns the subject's reporter
        # identity: another client's breaker points cannot silence detection for it.
        if vouched is not None and vouched == self._owners.get(subject.resource.label):
            return
        self._stats.evaluated += 1
        try:
            alerts = self.engine.observe(name, point)
        except Exception:
            # A detector bug must cost that one point, never ingestion or forwarding.
            self._stats.errors += 1
            if self._stats.errors <= 10:
                log.exception("detection failed on a point of %s", name)
            return
        for a in alerts:
            self._alerts.append((subject, a))
            for t in self.breaker.record_alert(a):
                self._transitions.append((subject, t))
        # After the alerts, so a condition that returns during probation re-opens with its alert.
        active: Callable[[str], frozenset[str]] = self._active_kinds
        if self._restored and name in self._restored:
            active = self._restored_kinds(name, point.time)
        for t in self.breaker.advance(name, point.time, active):
            self._transitions.append((subject, t))

    def _restored_kinds(self, name: str, now: float) -> Callable[[str], frozenset[str]]:
        """Conditions of a subject restored from the store: those that held its breaker, until
        the engine reports its own or has had ``_rejudge_s`` of data to do so."""
        kinds, since = self._restored[name]
        if since is None:
            since = now
            self._restored[name] = (kinds, since)
        own = self.engine.active_kinds(name)
        if own or now - since >= self._rejudge_s:
            del self._restored[name]
            return lambda _name: own
        return lambda _name: kinds

    def _stragglers_judged(self) -> None:
        """The straggler judge's alerts, and its windows' breaker times (under the lock)."""
        st = self._stragglers
        if st is None or not st.pending:
            return
        alerts, advances = st.take()
        for subject, a in alerts:
            self._alerts.append((subject, a))
            for t in self.breaker.record_alert(a):
                self._transitions.append((subject, t))
        for subject, at in advances:
            for t in self.breaker.advance(subject.name, at, st.active):
                self._transitions.append((subject, t))

    def _publish(self, now: float) -> None:
        """Persist, act on and send the events of the last request (under the lock)."""
        self._stragglers_judged()
        if not self._alerts and not self._transitions:
            return
        alerts, self._alerts = self._alerts, []
        transitions, self._transitions = self._transitions, []
        new_subjects: dict[str, dict[str, Any]] = {}
        for subject, a in alerts:
            key = (a.subject, a.kind)
            self._alert_counts[key] = self._alert_counts.get(key, 0) + 1
            if a.subject not in self._outputs:
                out = self._outputs[a.subject] = _output(subject)
                new_subjects[a.subject] = {
                    "resource": [list(kv) for kv in out.resource],
                    "attrs": [list(kv) for kv in out.attrs],
                }
            log.warning("alert %s %s: %s", a.kind, a.subject, a.message)
        self._stats.alerts += len(alerts)
        self._stats.transitions += len(transitions)
        state = self.breaker.export_state() if transitions else None
        # Durable before anyone is told: the store's writer calls _act once it is written.
        self._store.commit(state, [t for _, t in transitions], [a for _, a in alerts], new_subjects)
        empty = outputs.SubjectOutput((), ())
        payload = outputs.logs_request(
            [(self._outputs.get(a.subject, empty), a) for _, a in alerts],
            [(self._outputs.get(t.subject, empty), t) for _, t in transitions],
            int(now * 1e9),
        )
        self._send(LOGS_EXPORT, payload)

    def _act(self, batch: Batch) -> None:
        """Fire the actions of a batch the store has written (on the store's writer thread)."""
        if self._actions is not None:
            for t in batch.transitions:
                self._actions.on_transition(t)

    def _export_metrics(self, now: float) -> None:
        known = set(self.breaker.subjects())
        names = known | {s for s, _ in self._alert_counts}
        if not names:
            return
        by_subject: dict[str, dict[str, int]] = {}
        for (s, kind), n in self._alert_counts.items():
            by_subject.setdefault(s, {})[kind] = n
        values = []
        for name in sorted(names):
            out = self._outputs.get(name)
            if out is None:
                continue
            state = self.breaker.state(name)
            # The live estimate while the leak lasts; nothing once it cleared.
            leak = next((c for c in self.engine.conditions(name) if c.kind == LEAK), None)
            values.append(
                outputs.DetectorValues(
                    subject=out,
                    breaker_state=STATE_VALUES.get(state) if name in known else None,
                    leak_rate=None if leak is None else leak.rate_bytes_per_s,
                    time_to_exhaustion=None if leak is None else leak.eta_s,
                    alerts_by_kind=by_subject.get(name, {}),
                )
            )
        if values:
            self._send(
                METRICS_EXPORT, outputs.metrics_request(values, self._start_ns, int(now * 1e9))
            )
