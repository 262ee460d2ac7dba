"""The outbox's queues and retry schedule as a table, driven by a manual clock (no sleeps).

Each row is a script: ``enqueue`` a transition, ask ``next`` at a time what is due (what gets
sent, how long to wait, or None), ``settle`` the last sent delivery with a verdict at a time,
``close`` with a deadline; then the counters it must end with.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from otel_gpu.actions.notifiers import JsonNotifier, Reply, SlackNotifier
from otel_gpu.actions.outbox import Delivery, Outbox, RetryPolicy
from otel_gpu.detect.breaker import Transition

pytestmark = pytest.mark.unit

SLACK = "https://hooks.slack.com/services/T0001/B0002/SeCrEtToKeN99"
HOOK = "https://alerts.example/hook/pAtHsEcReT77"

OK = Reply(True)
FAIL = Reply(False, True, "HTTP 503 busy")
REFUSED = Reply(False, False, "HTTP 400 bad payload")


def opened(subject: str) -> Transition:
    return Transition(subject, "closed", "open", 1.0, f"{subject}: opened", None, 1)


def send(destination: str, subject: str) -> tuple[str, str]:
    return (destination, subject)


Step = tuple[Any, ...]
NO_JITTER = {"policy": RetryPolicy(max_attempts=5, backoff_s=1.0, backoff_max_s=3.0, jitter=0.0)}

CASES: list[tuple[str, dict[str, Any], list[Step], dict[str, int]]] = [
    (
        "delivered at the first attempt",
        NO_JITTER,
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, OK)]
        + [("next", 0.0, None)],
        {"queued": 1, "delivered": 1, "retried": 0},
    ),
    (
        "backoff doubles up to its cap, then the last attempt gives up",
        NO_JITTER,
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, FAIL)]
        + [("next", 0.0, 1.0), ("next", 0.5, 0.5), ("next", 1.0, send("slack", "gpu0"))]
        + [("settle", 1.0, FAIL), ("next", 1.0, 2.0), ("next", 3.0, send("slack", "gpu0"))]
        + [("settle", 3.0, FAIL), ("next", 3.0, 3.0), ("next", 6.0, send("slack", "gpu0"))]
        + [("settle", 6.0, FAIL), ("next", 6.0, 3.0), ("next", 9.0, send("slack", "gpu0"))]
        + [("settle", 9.0, FAIL), ("next", 9.0, None)],
        {"queued": 1, "delivered": 0, "retried": 4, "failed": 1},
    ),
    (
        "jitter shortens a backoff by up to its fraction",
        {"policy": RetryPolicy(backoff_s=1.0, jitter=0.2), "rand": lambda: 0.5},
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, FAIL)]
        + [("next", 0.0, 0.9)],
        {"retried": 1},
    ),
    (
        "a server's Retry-After replaces the backoff, within its cap",
        {"policy": RetryPolicy(backoff_s=1.0, retry_after_max_s=60.0, jitter=0.0)},
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, FAIL, 10.0)]
        + [("next", 0.0, 10.0), ("next", 10.0, send("slack", "gpu0"))]
        + [("settle", 10.0, FAIL, 3600.0), ("next", 10.0, 60.0)],
        {"retried": 2},
    ),
    (
        "a permanent refusal is not retried",
        NO_JITTER,
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, REFUSED)]
        + [("next", 0.0, None)],
        {"retried": 0, "failed": 1},
    ),
    (
        "a retry stays ahead of later notifications to its destination",
        NO_JITTER,
        [("enqueue", "gpu0"), ("enqueue", "gpu1"), ("next", 0.0, send("slack", "gpu0"))]
        + [("settle", 0.0, FAIL), ("next", 0.5, 0.5), ("next", 1.0, send("slack", "gpu0"))]
        + [("settle", 1.0, OK), ("next", 1.0, send("slack", "gpu1"))],
        {"queued": 2, "delivered": 1, "retried": 1},
    ),
    (
        "one destination's backoff does not hold another back",
        {**NO_JITTER, "destinations": 2},
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, FAIL)]
        + [("next", 0.0, send("webhook", "gpu0")), ("settle", 0.0, OK), ("next", 0.0, 1.0)],
        {"queued": 2, "delivered": 1, "retried": 1},
    ),
    (
        "a full queue drops its oldest waiting notification",
        {**NO_JITTER, "queue_size": 2},
        [("enqueue", "gpu0"), ("enqueue", "gpu1"), ("enqueue", "gpu2")]
        + [("next", 0.0, send("slack", "gpu1"))],
        {"queued": 3, "dropped": 1},
    ),
    (
        "closing still sends what is due before the deadline",
        NO_JITTER,
        [("enqueue", "gpu0"), ("close", 5.0), ("next", 0.0, send("slack", "gpu0"))]
        + [("settle", 0.0, OK), ("next", 0.0, None)],
        {"delivered": 1, "abandoned": 0},
    ),
    (
        "closing abandons at once a retry due after the deadline",
        NO_JITTER,
        [("enqueue", "gpu0"), ("next", 0.0, send("slack", "gpu0")), ("settle", 0.0, FAIL)]
        + [("close", 0.5), ("next", 0.0, None)],
        {"retried": 1, "abandoned": 1},
    ),
    (
        "the deadline passing abandons everything still waiting",
        NO_JITTER,
        [("enqueue", "gpu0"), ("enqueue", "gpu1"), ("close", 1.0), ("next", 1.0, None)],
        {"queued": 2, "abandoned": 2},
    ),
    (
        "after close a notification is dropped for every destination",
        {**NO_JITTER, "destinations": 2},
        [("close", 5.0), ("enqueue", "gpu0"), ("next", 0.0, None)],
        {"queued": 0, "dropped": 2},
    ),
]


def build(options: dict[str, Any]) -> Outbox:
    opts = dict(options)
    notifiers = [SlackNotifier(SLACK), JsonNotifier(HOOK)][: opts.pop("destinations", 1)]
    return Outbox(notifiers, **opts)


@pytest.mark.parametrize(
    ("options", "steps", "counts"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_schedule(options: dict[str, Any], steps: list[Step], counts: dict[str, int]) -> None:
    names = ["slack", "webhook"]
    box = build(options)
    sent: Delivery | None = None
    for step in steps:
        op, *args = step
        if op == "enqueue":
            box.enqueue(opened(args[0]), "open")
        elif op == "close":
            box.close(args[0])
        elif op == "settle":
            assert sent is not None, "settle needs a delivery in flight"
            box.settle(sent, args[1], args[0], *args[2:])
            sent = None
        else:
            now, want = args
            got = box.next_due(now)
            if isinstance(got, Delivery):
                assert (names[got.destination], got.transition.subject) == want, step
                sent = got
            elif want is None:
                assert got is None, step
            else:
                assert got == pytest.approx(want), step
    stats = vars(box.stats)
    assert {k: stats[k] for k in counts} == counts


def test_in_flight_until_settled() -> None:
    box = build(NO_JITTER)
    box.enqueue(opened("gpu0"), "open")
    item = box.next_due(0.0)
    assert isinstance(item, Delivery) and box.in_flight == 1 and not box.idle
    box.settle(item, OK, 0.0)
    assert box.in_flight == 0 and box.idle


def test_notes_name_the_destination_and_never_its_secret() -> None:
    box = build({**NO_JITTER, "queue_size": 1})
    box.enqueue(opened("gpu0"), "open")
    box.enqueue(opened("gpu1"), "open")  # drops gpu0
    item = box.next_due(0.0)
    assert isinstance(item, Delivery)
    # An I/O error that echoes the request URL (as some servers and proxies do).
    box.settle(item, Reply(False, True, f"HTTP 502 upstream {SLACK} failed"), 0.0)
    notes = box.take_notes()
    text = [msg % args for _, msg, args in notes]
    assert [level for level, _, _ in notes] == [logging.WARNING, logging.INFO]
    assert "queue for slack full: dropped open of gpu0" in text[0]
    assert "retrying open notification for gpu1 to slack https://hooks.slack.com/…" in text[1]
    assert "HTTP 502 upstream … failed" in text[1]
    assert not any("SeCrEtToKeN99" in t for t in text)
    assert box.take_notes() == []
