"""Admission of export requests: bearer token, memory limit, in-flight cap, request rate.

Refusals are :class:`Refused` with a gRPC code; overload ones carry a RetryInfo delay so that
the OTel exporters and collectors in front wait and retry instead of losing data. The token is
checked from the call's metadata alone (:meth:`Admission.authorized`), before the body is read.
"""

from __future__ import annotations

import hmac
import threading
import time
from typing import Any

import grpc

from otel_gpu.processor.memlimit import MemoryLimiter
from otel_gpu.processor.settings import ProcessorConfig


class Refused(Exception):
    """A request refused with ``code``; ``retry_s`` is the RetryInfo delay, if any."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_s = code, message, retry_s


class RateLimit:
    """Token bucket over requests (burst = one second's worth)."""

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self._tokens = max(per_s, 1.0)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> float:
        """0 if admitted, else seconds until a token is due."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(max(self.per_s, 1.0), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.per_s


class Admission:
    """Decides whether a request may enter; ``admit`` takes an in-flight slot, ``release``
    gives it back."""

    def __init__(self, config: ProcessorConfig, memory: MemoryLimiter) -> None:
        self.config = config
        self.memory = memory
        self._token = None if config.token is None else config.token.encode()
        self._inflight = threading.BoundedSemaphore(config.max_inflight)
        self._rate = RateLimit(config.max_requests_per_s) if config.max_requests_per_s else None

    def authorized(self, metadata: Any) -> bool:
        """Whether ``metadata`` (the call's invocation metadata) holds the bearer token."""
        if self._token is None:
            return True
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                scheme, _, token = given.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token):
                    return True
        return False

    def admit(self) -> None:
        """Take an in-flight slot (released by the caller) or refuse with a retry delay."""
        retry = self.config.retry_after_s
        if self.memory.limited:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"processor memory {self.memory.rss / 2**20:.0f} MiB is above its soft limit "
                f"({self.memory.soft / 2**20:.0f} MiB of --memory-limit-mib "
                f"{self.memory.hard / 2**20:.0f}); retry later",
                retry,
            )
        if not self._inflight.acquire(blocking=False):
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"processor busy ({self.config.max_inflight} requests in flight)",
                retry,
            )
        if self._rate is not None:
            wait = self._rate.take()
            if wait > 0:
                self._inflight.release()
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"over the admission rate of {self._rate.per_s:g} requests/s",
                    max(retry, wait),
                )

    def release(self) -> None:
        self._inflight.release()
