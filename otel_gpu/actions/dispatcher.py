"""Actions fired on breaker transitions: log record, span event, stop, webhooks.

``ActionDispatcher.on_transition`` never blocks: it logs, adds a span event, optionally stops the
job (both in-memory / one syscall), and queues webhook deliveries in the outbox
(``otel_gpu.actions.outbox``: bounded per-destination queues, retries, backoff, Retry-After).
One background thread sends what the outbox says is due, with a per-request timeout, and
settles each reply back into it. ``close`` is bounded.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from otel_gpu.actions.http import build_opener, post, retry_after_s
from otel_gpu.actions.notifiers import Reply, WebhookNotifier
from otel_gpu.actions.outbox import Delivery, DeliveryStats, Outbox, RetryPolicy
from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.actions.span_event import DIAGNOSIS_LINES, add_alert_event
from otel_gpu.actions.stop import JobStopper
from otel_gpu.core.printable import printable
from otel_gpu.core.redact import redact_text
from otel_gpu.core.signals import (
    ALERT_DIAGNOSIS,
    ALERT_KIND,
    ALERT_SEVERITY,
    BREAKER_EPISODE,
    BREAKER_FROM,
    BREAKER_STATE,
    BREAKER_SUBJECT,
    BREAKER_TIME,
    LEAK_RATE,
    TIME_TO_EXHAUSTION,
)
from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN, Transition
from otel_gpu.detect.model import LEAK, STALL

log = logging.getLogger("otel_gpu.actions")

_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


def transition_event(t: Transition) -> str:
    """Which notify setting a transition falls under: open, reopen, half_open or closed."""
    if t.to_state == OPEN:
        return "reopen" if t.from_state == HALF_OPEN else "open"
    if t.to_state == HALF_OPEN:
        return "half_open"
    return "closed" if t.to_state == CLOSED else t.to_state


class ActionDispatcher:
    """Fires the actions for each breaker transition. Thread-safe; one sender thread."""

    def __init__(
        self,
        notifiers: Sequence[WebhookNotifier] = (),
        *,
        notify_on: Iterable[str] = ("open", "closed"),
        queue_size: int = 256,
        max_attempts: int = 5,
        timeout_s: float = 5.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        retry_after_max_s: float = 60.0,
        jitter: float = 0.2,
        span_events: bool = True,
        stopper: JobStopper | None = None,
        stop_kinds: Iterable[str] = (LEAK, STALL),
        source: str = "",
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._notifiers = list(notifiers)
        self._notify_on = frozenset(notify_on)
        self._timeout_s = float(timeout_s)
        self._span_events = span_events
        self._stopper = stopper
        self._stop_kinds = frozenset(stop_kinds)
        self._stopped_episodes: set[tuple[str, int]] = set()
        self._source = source
        self._wall = wall_clock
        self._clock = clock
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._outbox = Outbox(
            self._notifiers,
            queue_size=queue_size,
            policy=RetryPolicy(max_attempts, backoff_s, backoff_max_s, retry_after_max_s, jitter),
        )
        self._thread: threading.Thread | None = None
        self._opener = build_opener()

    @classmethod
    def from_config(
        cls,
        config: ActionsConfig,
        *,
        stopper: JobStopper | None = None,
        allowed_pids: Callable[[], Iterable[int]] | None = None,
        request_fn: Callable[[str], bool] | None = None,
        source: str = "",
    ) -> ActionDispatcher:
        """Build from settings.

        The stop action is used only when ``config.stop_on_alert`` is set: either the given
        ``stopper`` (its signal becomes ``config.stop_signal``) or one built from
        ``allowed_pids`` (the watched job's trainer PIDs) and ``request_fn``. ``source`` names
        the job or host in messages.
        """
        if not config.stop_on_alert:
            stopper = None
        elif stopper is not None:
            stopper.signal = signal.Signals[config.stop_signal]
        elif allowed_pids is not None or request_fn is not None:
            stopper = JobStopper(
                allowed_pids or (lambda: ()),
                signal=config.stop_signal,
                request_fn=request_fn,
            )
        else:
            log.warning("OTEL_GPU_STOP_ON_ALERT is set but there is no job here to stop")
        return cls(
            config.notifiers(),
            notify_on=config.notify_on,
            queue_size=config.queue_size,
            max_attempts=config.max_attempts,
            timeout_s=config.timeout_s,
            backoff_s=config.backoff_s,
            backoff_max_s=config.backoff_max_s,
            retry_after_max_s=config.retry_after_max_s,
            span_events=config.span_events,
            stopper=stopper,
            stop_kinds=config.stop_kinds,
            source=source,
        )

    @property
    def stats(self) -> DeliveryStats:
        with self._cv:
            return DeliveryStats(**vars(self._outbox.stats))

    def on_transition(self, t: Transition, notify: bool = True) -> None:
        """Fire the actions for ``t``. Never blocks on I/O and never raises. ``notify``:
        False when ``t`` is context of another subject's problem (a GPU whose process is the
        cause): logged, no notification of its own."""
        if os.getpid() != self._pid:
            return  # a forked child (e.g. a DataLoader worker) must not act for its parent
        try:
            self._log(t)
            if t.to_state == OPEN and t.alert is not None:
                if self._span_events:
                    add_alert_event(t.alert)
                self._maybe_stop(t)
            event = transition_event(t)
            if notify and event in self._notify_on and self._notifiers:
                self._enqueue(t, event)
        except Exception as e:  # an action must never break detection
            log.error("action for %s failed: %s", t.subject, type(e).__name__)

    def _log(self, t: Transition) -> None:
        a = t.alert
        extra: dict[str, object] = {
            BREAKER_SUBJECT: t.subject,
            BREAKER_FROM: t.from_state,
            BREAKER_STATE.name: t.to_state,
            BREAKER_EPISODE: t.episode,
            BREAKER_TIME: t.time,
        }
        if a is not None:
            extra[ALERT_KIND] = a.kind
            extra[ALERT_SEVERITY] = a.severity
            if a.rate_bytes_per_s is not None:
                extra[LEAK_RATE.name] = a.rate_bytes_per_s
            if a.eta_s is not None:
                extra[TIME_TO_EXHAUSTION.name] = a.eta_s
        where = ""
        if a is not None and a.diagnosis is not None and t.to_state == OPEN:
            shown = [redact_text(line) for line in a.diagnosis.shown(DIAGNOSIS_LINES)]
            extra[ALERT_DIAGNOSIS] = shown
            where = f"; where: {shown[0]}" if shown else ""
        level = logging.WARNING if t.to_state == OPEN else logging.INFO
        log.log(
            level,
            "breaker %s: %s -> %s (episode %d): %s%s",
            printable(t.subject),  # in a job, its own handlers print this: no escapes
            t.from_state,
            t.to_state,
            t.episode,
            printable(t.reason),
            printable(where),
            extra=extra,
        )

    def _maybe_stop(self, t: Transition) -> None:
        assert t.alert is not None
        if self._stopper is None or t.alert.kind not in self._stop_kinds:
            return
        key = (t.subject, t.episode)
        refused = self._stopper.refusal(t.alert)
        if refused is not None:
            log.warning(
                "not stopping the job for %s on %s: %s", t.alert.kind, printable(t.subject), refused
            )
            with self._cv:
                self._outbox.stats.stops_refused += 1
            return
        with self._cv:
            if key in self._stopped_episodes:
                return  # once per episode
            if len(self._stopped_episodes) > 10_000:
                self._stopped_episodes.clear()
            self._stopped_episodes.add(key)
            self._outbox.stats.stops += 1
        self._stopper.stop(f"{t.alert.kind} on {t.subject}: {t.alert.message}")

    def _enqueue(self, t: Transition, event: str) -> None:
        with self._cv:
            self._outbox.enqueue(t, event)
            if self._thread is None and not self._outbox.closing:
                self._thread = threading.Thread(
                    target=self._run, name="otel-gpu-actions", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()
        self._emit_logs()

    def _emit_logs(self) -> None:
        # Log calls wait until the lock is released: a slow handler must never hold up
        # on_transition.
        with self._cv:
            pending = self._outbox.take_notes()
        for level, msg, args in pending:
            log.log(level, msg, *args)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until nothing is queued or in flight; True if that happened in time."""
        end = self._clock() + timeout_s
        with self._cv:
            while not self._outbox.idle:
                left = end - self._clock()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Deliver what is queued within ``timeout_s``, then stop. Returns within about
        ``timeout_s``; True if every queued notification was settled (delivered or given up)
        and none had to be abandoned.

        Requests started during close get at most the time left; deliveries whose next
        retry falls after the deadline are abandoned (counted in ``stats.abandoned``) at once.
        Later ``on_transition`` calls still log, add span events and stop, but send nothing.
        """
        with self._cv:
            self._outbox.close(self._clock() + max(0.0, timeout_s))
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(max(0.0, self._outbox.time_left(self._clock())) + 0.05)
        with self._cv:
            alive = thread is not None and thread.is_alive()
            lost = self._outbox.abandon_all() if alive else 0
            stats = self._outbox.stats
            clean = lost == 0 and stats.abandoned == 0 and not self._outbox.in_flight
        self._emit_logs()
        return clean

    def _run(self) -> None:
        """The sender thread: take what is due, send it outside the lock, settle it."""
        while True:
            with self._cv:
                item = self._next()
            self._emit_logs()
            if item is None:
                return
            try:
                reply, retry_after = self._attempt(self._notifiers[item.destination], item)
            except Exception as e:  # a bug in one payload must not kill the sender
                reply, retry_after = Reply(False, False, f"internal error {type(e).__name__}"), None
            with self._cv:
                self._outbox.settle(item, reply, self._clock(), retry_after)
                self._cv.notify_all()
            self._emit_logs()

    def _next(self) -> Delivery | None:
        """Under the lock: wait for the next due delivery; None when closing is complete."""
        while True:
            due = self._outbox.next_due(self._clock())
            if isinstance(due, Delivery):
                return due
            if due is None and self._outbox.closing:
                return None
            self._cv.wait(due)  # None: until something is queued or close() is called

    def _attempt(self, n: WebhookNotifier, item: Delivery) -> tuple[Reply, float | None]:
        """One POST. Returns the verdict and a Retry-After delay (seconds) if the server gave one."""
        req = n.build(item.transition, self._wall(), self._source)
        with self._cv:
            left = self._outbox.time_left(self._clock())
        timeout = max(0.05, min(self._timeout_s, left))
        try:
            status, headers, body = post(self._opener, req, timeout)
        except TimeoutError:
            return Reply(False, True, f"no reply within {timeout:.2f} s"), None
        except (OSError, ValueError) as e:
            # URLError, refused connections, DNS and TLS failures; the text is scrubbed later.
            reason = getattr(e, "reason", None) or e
            return Reply(False, True, f"{type(e).__name__}: {reason}"), None
        retry_after = retry_after_s(headers.get("retry-after"), self._wall())
        if 200 <= status < 300:
            return n.judge(status, body), None
        snippet = body[:200].decode("utf-8", "replace").strip()
        error = f"HTTP {status} {snippet}".strip()
        return Reply(False, status in _RETRY_STATUSES, error), retry_after
