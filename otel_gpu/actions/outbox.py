"""The webhook outbox: per-destination bounded queues and the retry schedule, with no I/O.

Time is passed in (``now``, monotonic seconds) and jitter comes from an injected source, so the
whole retry policy is plain logic: the dispatcher's sender thread asks ``next_due(now)`` what to
send, sends it, and reports the verdict with ``settle``. Not thread-safe: the dispatcher holds
its lock around every call. Log lines are collected (``take_notes``) rather than logged here,
so the caller can emit them outside its lock.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from otel_gpu.actions.notifiers import Reply, WebhookNotifier
from otel_gpu.actions.redact import scrub
from otel_gpu.core.backoff import exponential
from otel_gpu.detect.breaker import Transition

Note = tuple[int, str, tuple[object, ...]]  # (log level, message, args)


@dataclass
class DeliveryStats:
    """Counters since start (a snapshot)."""

    queued: int = 0
    delivered: int = 0
    retried: int = 0  # attempts after the first
    failed: int = 0  # gave up: attempts exhausted or a permanent refusal
    dropped: int = 0  # queue full (oldest waiting one dropped) or queued after close
    abandoned: int = 0  # still waiting when close() ran out of time
    stops: int = 0  # stop actions taken (counted by the dispatcher)
    stops_refused: int = 0  # stop-kind alerts that were not the job's own (another tenant's)


@dataclass
class Delivery:
    """One notification of one transition to one destination."""

    destination: int  # index into the outbox's notifiers
    transition: Transition
    event: str
    attempt: int = 0  # attempts made so far
    due: float = 0.0  # monotonic time it may be sent


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how soon a failed delivery is tried again."""

    max_attempts: int = 5  # first try included
    backoff_s: float = 1.0  # first retry delay; doubles each retry
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 60.0  # cap on a server's Retry-After
    jitter: float = 0.2  # each backoff is shortened by up to this fraction

    def delay(self, attempt: int, retry_after: float | None, rand: float) -> float:
        """Seconds before the next try after ``attempt`` failed ones; ``rand`` in [0, 1)."""
        if retry_after is not None:
            return min(retry_after, self.retry_after_max_s)
        backoff = exponential(attempt - 1, self.backoff_s, self.backoff_max_s)
        return backoff * (1.0 - self.jitter * rand)


class Outbox:
    """FIFO per destination, so a dead Slack does not hold DingTalk back and each destination
    keeps its order; when a queue is full its oldest waiting delivery is dropped."""

    def __init__(
        self,
        notifiers: Sequence[WebhookNotifier],
        *,
        queue_size: int = 256,
        policy: RetryPolicy | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._notifiers = list(notifiers)
        self._queue_size = max(1, int(queue_size))
        p = policy or RetryPolicy()
        self.policy = RetryPolicy(
            max_attempts=max(1, int(p.max_attempts)),
            backoff_s=float(p.backoff_s),
            backoff_max_s=float(p.backoff_max_s),
            retry_after_max_s=float(p.retry_after_max_s),
            jitter=min(max(float(p.jitter), 0.0), 1.0),
        )
        self._rand = rand
        self._queues: list[deque[Delivery]] = [deque() for _ in self._notifiers]
        self.stats = DeliveryStats()
        self.in_flight = 0
        self.closing = False
        self.deadline = float("inf")
        self._notes: list[Note] = []

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing in flight."""
        return not self.in_flight and not any(self._queues)

    def enqueue(self, t: Transition, event: str) -> None:
        """One delivery of ``t`` per destination (dropped, and counted, once closing)."""
        if self.closing:
            self.stats.dropped += len(self._queues)
            return
        for i, q in enumerate(self._queues):
            if len(q) >= self._queue_size:
                old = q.popleft()  # oldest waiting; the newest state matters most
                self.stats.dropped += 1
                if self.stats.dropped == 1 or self.stats.dropped % 100 == 0:
                    self._note(
                        logging.WARNING,
                        "notification queue for %s full: dropped %s of %s (%d dropped so far)",
                        self._notifiers[i].name,
                        old.event,
                        old.transition.subject,
                        self.stats.dropped,
                    )
            q.append(Delivery(i, t, event))
            self.stats.queued += 1

    def next_due(self, now: float) -> Delivery | float | None:
        """The delivery to send now (taken off its queue and counted in flight); else the
        seconds until the earliest one is due; else None: nothing waits, or closing is over.

        While closing, deliveries due after the deadline are abandoned at once, and everything
        is abandoned once ``now`` reaches it.
        """
        while True:
            if self.closing and now >= self.deadline:
                self.abandon_all()
                return None
            heads = [q[0] for q in self._queues if q]
            if not heads:
                return None
            item = min(heads, key=lambda d: d.due)  # ties: the first destination
            if self.closing and item.due > self.deadline:
                self._queues[item.destination].popleft()
                self.stats.abandoned += 1
                self._note(
                    logging.WARNING,
                    "closing: gave up %s notification for %s to %s (next retry after the deadline)",
                    item.event,
                    item.transition.subject,
                    self._notifiers[item.destination].name,
                )
                continue
            if item.due > now:
                return item.due - now
            self._queues[item.destination].popleft()
            self.in_flight += 1
            return item

    def settle(
        self, item: Delivery, reply: Reply, now: float, retry_after: float | None = None
    ) -> None:
        """Record the verdict on an attempt at ``item``: delivered, retried later (at the head of
        its destination's queue, keeping that destination's order) or given up."""
        self.in_flight -= 1
        n = self._notifiers[item.destination]
        item.attempt += 1
        what = f"{item.event} notification for {item.transition.subject} to {n.name} {n.redacted}"
        if reply.ok:
            self.stats.delivered += 1
            self._note(logging.DEBUG, "delivered %s (attempt %d)", what, item.attempt)
            return
        error = scrub(reply.error, n.secrets)
        if reply.retry and item.attempt < self.policy.max_attempts:
            delay = self.policy.delay(item.attempt, retry_after, self._rand())
            item.due = now + delay
            self.stats.retried += 1
            self._queues[item.destination].appendleft(item)
            self._note(logging.INFO, "retrying %s in %.2f s: %s", what, delay, error)
            return
        self.stats.failed += 1
        self._note(logging.WARNING, "gave up %s after %d attempt(s): %s", what, item.attempt, error)

    def close(self, deadline: float) -> None:
        """Accept nothing more; what waits may still be sent until ``deadline``."""
        self.closing = True
        self.deadline = deadline

    def time_left(self, now: float) -> float:
        """Seconds until the close deadline (infinite before close)."""
        return self.deadline - now

    def abandon_all(self) -> int:
        """Give up everything still waiting; returns how many."""
        n = sum(len(q) for q in self._queues)
        for q in self._queues:
            q.clear()
        if n:
            self.stats.abandoned += n
            self._note(logging.WARNING, "closing: %d notification(s) not delivered in time", n)
        return n

    def take_notes(self) -> list[Note]:
        """The log lines collected since the last call."""
        notes, self._notes = self._notes, []
        return notes

    def _note(self, level: int, msg: str, *args: object) -> None:
        self._notes.append((level, msg, args))
