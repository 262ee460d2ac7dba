"""The instrument of a signal, and the guard around every reader the SDK calls.

Every observable instrument of the project is made by :func:`observable`, so each one has the
declared name, kind, unit and description, and each of its callbacks runs inside a
:class:`GuardedReader`: a reader that raises loses that collection's points of that
instrument, never the collection, and is logged once per episode (its first failure, with the
place it failed; a line when it reads again), not once per collection as the SDK would, with a
traceback each export interval.
"""

import logging
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_gpu.core.redact import redact_text
from otel_gpu.core.signals.model import COUNTER, GAUGE, UPDOWN, Signal

log = logging.getLogger("otel_gpu.signals")

Callback = Callable[[CallbackOptions], Iterable[Observation]]


class GuardedReader:
    """One instrument callback that never raises into the SDK.

    Collections of one instrument may run on two readers' threads at once (OTLP and a
    Prometheus scrape): a race can at worst say the same episode twice.
    """

    __slots__ = ("metric", "read", "failures")

    def __init__(self, metric: str, read: Callback) -> None:
        self.metric = metric
        self.read = read
        self.failures = 0  # collections failed in a row (the current episode)

    def __call__(self, options: CallbackOptions) -> list[Observation]:
        try:
            observed = self.read(options)
            # A generator raises while it is consumed: consume it here, inside the guard.
            observations = observed if isinstance(observed, list) else list(observed)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "otel-gpu: reading %s failed (%s); its points are left out until it reads "
                    "again (logged once until then)",
                    self.metric,
                    _where(exc),
                )
            return []
        if self.failures:
            log.info(
                "otel-gpu: reading %s works again after %d failed collections",
                self.metric,
                self.failures,
            )
            self.failures = 0
        return observations


def _where(exc: Exception) -> str:
    """``Type: message at file:line`` of the innermost frame, the message redacted."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {redact_text(str(exc))}{at}"


def observable(meter: Meter, signal: Signal, callbacks: Sequence[Callback]) -> Any:
    """Create the observable instrument of ``signal``'s kind, name, unit and description, each
    callback guarded (:class:`GuardedReader`)."""
    make = {
        GAUGE: meter.create_observable_gauge,
        COUNTER: meter.create_observable_counter,
        UPDOWN: meter.create_observable_up_down_counter,
    }[signal.kind]
    return make(
        signal.name,
        callbacks=[GuardedReader(signal.name, c) for c in callbacks],
        unit=signal.unit,
        description=signal.description,
    )
