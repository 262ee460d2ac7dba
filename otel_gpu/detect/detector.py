"""What the engine asks of a detector, and the conditions detectors report. Pure, no I/O.

A detector keeps the evidence of one subject. The engine makes one per subject for every
registered detector (``otel_gpu.detect.engine.DETECTORS``), feeds it each point in data-time
order, collects the alerts it raises, and asks it which conditions still hold. An alert marks
the moment a condition starts; the condition then stays *active* until the detector sees it
end (a leak's floor stops rising, a stalled job works again, a temperature falls back). The
breaker keeps a subject OPEN while a condition that opened it is active, so "resolved" means
the problem stopped, not merely that it stopped being new.

Adding a detector: one class with this shape (usually in its own module, its settings fields
in ``settings.py``) and one entry in ``DETECTORS``; its ``KINDS`` become stop kinds by
themselves. A class of this shape in ``otel_gpu.detect`` left out of ``DETECTORS`` fails
``tests/test_detect_registry.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from otel_gpu.detect.model import Alert, Point
from otel_gpu.detect.settings import DetectConfig

NO_ALERTS: tuple[Alert, ...] = ()  # the common answer, shared to spare an allocation per point


@dataclass(frozen=True, slots=True)
class Condition:
    """A problem that holds now for one subject.

    ``rate_bytes_per_s`` and ``eta_s`` are the detector's current estimates (leaks), not the
    values of the alert that raised the condition: they follow the data while it lasts.
    """

    kind: str  # the kind of the alert that raised it (model.LEAK, STALL ...)
    since: float  # data time it began
    rate_bytes_per_s: float | None = None
    eta_s: float | None = None  # seconds from the subject's latest point to its memory limit


class Detector(Protocol):
    """One detector's evidence about one subject."""

    # The alert kinds (model.LEAK, STALL ...) its alerts and conditions carry: what
    # OTEL_GPU_STOP_KINDS accepts is derived from these (engine.ALERT_KINDS).
    KINDS: ClassVar[tuple[str, ...]]

    def __init__(self, cfg: DetectConfig) -> None: ...

    @classmethod
    def enabled(cls, cfg: DetectConfig) -> bool:
        """Whether the settings turn this detector on (the engine skips it otherwise)."""
        ...

    def observe(self, subject: str, point: Point) -> Sequence[Alert]:
        """Feed one point (never older than the previous one); the alerts that start here."""
        ...

    def conditions(self, now: float) -> Sequence[Condition]:
        """The conditions active after the latest point; ``now`` is that point's time."""
        ...
