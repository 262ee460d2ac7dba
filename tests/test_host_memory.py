"""Host memory by source line through tracemalloc (otel_gpu/diagnose/host_memory.py and the
trainer's memory.tracemalloc operation), in this process (issue 20 §2)."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from otel_gpu.diagnose import host_memory
from otel_gpu.diagnose.memory_settings import MemorySettings
from otel_gpu.tracing.memory_ops import tracemalloc_handler

pytestmark = pytest.mark.unit

kept: list[bytes] = []


def _leak_a_little() -> None:
    kept.append(bytes(100_000))  # the growing line


def test_the_growing_line_is_named_and_tracing_is_stopped_after() -> None:
    assert not tracemalloc.is_tracing()
    handle = tracemalloc_handler(MemorySettings())
    stop = threading.Event()

    def job() -> None:
        while not stop.is_set():
            _leak_a_little()
            time.sleep(0.01)

    t = threading.Thread(target=job)
    t.start()
    try:
        reply = handle({"over_s": 0.5, "top": 5})
    finally:
        stop.set()
        t.join()
        kept.clear()
    assert not tracemalloc.is_tracing()  # started for the request, stopped after
    first = reply["lines"][0]
    line = _leak_a_little.__code__.co_firstlineno + 1
    assert first["site"].endswith(f"test_host_memory.py:{line}"), reply["lines"]
    assert first["growth_bytes"] >= 10 * 100_000 and first["growth_count"] >= 10


def test_tracing_someone_else_started_is_left_running() -> None:
    tracemalloc.start()
    try:
        assert host_memory.start() is False
        tracemalloc_handler(MemorySettings())({"over_s": 0})
        assert tracemalloc.is_tracing()
    finally:
        tracemalloc.stop()
