"""Bounded shutdown: every flush and close runs on a daemon thread that is abandoned at the
deadline, so a collector that never answers cannot hold a command or a job at exit (the SDK's
own exit handlers took about 43 s with the collector down and default settings)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.metrics import MeterProvider

log = logging.getLogger("otel_gpu.export")


def bounded(fn: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s``; True if it finished."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            log.debug("%s failed", what, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name=f"otel-gpu-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("%s did not finish within %.1f s; continuing without it", what, timeout_s)
        return False
    return True


def close_all(steps: Sequence[tuple[str, Callable[[float], object]]], timeout_s: float) -> bool:
    """Run every ``step(timeout_s)`` in parallel and wait for them until one shared deadline.

    One bound for the whole shutdown (``OTEL_GPU_SHUTDOWN_TIMEOUT``), not one per step: steps
    that overrun are abandoned on their daemon threads. True if all finished in time.
    """
    deadline = time.monotonic() + timeout_s
    threads = []
    for name, step in steps:
        thread = threading.Thread(
            target=_quietly,
            args=(name, step, timeout_s),
            name=f"otel-gpu-close-{name}",
            daemon=True,
        )
        thread.start()
        threads.append((name, thread))
    late = []
    for name, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            late.append(name)
    if late:
        log.warning("shutdown of %s did not finish within %.1f s", ", ".join(late), timeout_s)
    return not late


def _quietly(name: str, step: Callable[[float], object], timeout_s: float) -> None:
    try:
        step(timeout_s)
    except Exception:
        log.debug("%s shutdown failed", name, exc_info=True)


def shutdown_provider(provider: MeterProvider, timeout_s: float) -> bool:
    """Flush and shut down within ``timeout_s`` seconds, whatever the collector does."""
    timeout_ms = max(1.0, timeout_s * 1000.0)
    return bounded(
        lambda: provider.shutdown(timeout_millis=timeout_ms), timeout_s, "metric shutdown"
    )
