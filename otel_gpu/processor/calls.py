"""Calls as gRPC sees them before their message: a per-peer limit and a receive deadline.

A call that sends its headers and never its message holds a server thread and one of gRPC's
``maximum_concurrent_rpcs`` for as long as the client likes; 128 of them locked every client out
(issue 18.5). The export handlers therefore take the request stream as soon as the call
begins and, before reading the message:

- :meth:`CallGuard.enter` counts the call against its peer's address (the address, not the
  port: a client opening more connections is still one peer); a peer already holding
  ``per_peer`` calls is refused at once, without a thread held for it;
- :meth:`CallGuard.watch` arms the receive deadline: a call whose message has not arrived
  ``receive_s`` after it began is cancelled (one reaper thread for all calls).

Both refusals are counted (:meth:`CallGuard.snapshot`) and the recent ones are named in
``/healthz``. Thread-safe.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable

_RECENT_S = 60.0  # refusals this recent are named in /healthz


def peer_address(peer: str) -> str:
    """The address part of gRPC's ``context.peer()`` (``ipv4:10.0.0.5:41234`` → ``10.0.0.5``,
    ``ipv6:[::1]:5000`` → ``::1``); anything else (a Unix socket) as it is."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


class CallGuard:
    """Per-peer call counts and the receive deadlines of calls waiting for their message."""

    def __init__(
        self, per_peer: int, receive_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_peer = per_peer
        self.receive_s = receive_s
        self._clock = clock
        self._lock = threading.Condition()
        self._calls: Counter[str] = Counter()
        self._due: list[tuple[float, int]] = []  # (deadline, token), a heap
        self._cancels: dict[int, Callable[[], None]] = {}
        self._tokens = itertools.count()
        self._reaper: threading.Thread | None = None
        self._closed = False
        self.peer_limited = 0  # calls refused: their peer held per_peer calls already
        self.receive_timeouts = 0  # calls cancelled: no message within receive_s
        self._last_refusal: float | None = None

    def enter(self, peer: str) -> bool:
        """Count a call of ``peer``; False (and counted) when the peer is at its limit."""
        with self._lock:
            if self._calls[peer] >= self.per_peer:
                self.peer_limited += 1
                self._last_refusal = self._clock()
                return False
            self._calls[peer] += 1
            return True

    def leave(self, peer: str) -> None:
        with self._lock:
            self._calls[peer] -= 1
            if self._calls[peer] <= 0:
                del self._calls[peer]

    def watch(self, cancel: Callable[[], None]) -> int:
        """Call ``cancel`` if :meth:`unwatch` has not come within ``receive_s``; a token."""
        with self._lock:
            token = next(self._tokens)
            self._cancels[token] = cancel
            heapq.heappush(self._due, (self._clock() + self.receive_s, token))
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="otel-gpu-receive-deadline", daemon=True
                )
                self._reaper.start()
            self._lock.notify()
            return token

    def unwatch(self, token: int) -> bool:
        """Disarm ``token``'s deadline; False when it had already fired (the call was
        cancelled for its silence)."""
        with self._lock:
            return self._cancels.pop(token, None) is not None

    def _reap(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    while self._due and self._due[0][1] not in self._cancels:
                        heapq.heappop(self._due)  # answered in time
                    if self._due and self._due[0][0] <= self._clock():
                        break
                    wait = self._due[0][0] - self._clock() if self._due else None
                    self._lock.wait(wait)
                if self._closed:
                    return
                _, token = heapq.heappop(self._due)
                cancel = self._cancels.pop(token)
                self.receive_timeouts += 1
                self._last_refusal = self._clock()
            with contextlib.suppress(Exception):  # a call that ended meanwhile
                cancel()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "peer_limited": self.peer_limited,
                "receive_timeouts": self.receive_timeouts,
                "peers": len(self._calls),
            }

    def problem(self) -> str | None:
        """A line on the calls refused lately, for ``/healthz`` (None when there were none)."""
        with self._lock:
            last = self._last_refusal
            if last is None or self._clock() - last > _RECENT_S:
                return None
            return (
                f"calls refused: {self.peer_limited} over the limit of {self.per_peer} per "
                f"peer, {self.receive_timeouts} that sent no message within "
                f"{self.receive_s:g} s (see /stats calls)"
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
