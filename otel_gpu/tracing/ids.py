"""Span and trace id generators for the SDK's TracerProvider."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID


class SystemRandomIdGenerator(RandomIdGenerator):
    """Ids from the OS's randomness.

    The SDK's generator draws from the global ``random`` module, which training scripts seed
    (HF ``set_seed(42)``): every rank, and every run, then produced the same span ids.
    """

    _random = random.SystemRandom()

    def generate_span_id(self) -> int:
        span_id = self._random.getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = self._random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self._random.getrandbits(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = self._random.getrandbits(128)
        return trace_id


class PresetIdGenerator(SystemRandomIdGenerator):
    """Random ids, except inside :meth:`preset` where the next span gets the given ids.

    The configurator installs it so the process that owns the ``train`` root can create it with
    the ids its launcher already handed to every rank.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def preset(self, trace_id: int, span_id: int) -> Iterator[None]:
        self._local.ids = [trace_id, span_id]
        try:
            yield
        finally:
            self._local.ids = None

    def generate_trace_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        return ids[0] if ids else super().generate_trace_id()

    def generate_span_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        if ids:
            self._local.ids = None  # one span only
            return int(ids[1])
        return super().generate_span_id()
