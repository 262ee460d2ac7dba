"""Data the detection engine takes in and gives out. Pure data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

# Alert kinds (contract: `otel-gpu analyze` prints these).
LEAK = "leak"
STALL = "stall"
THRESHOLD = "threshold"
ANOMALY = "anomaly"
HARDWARE = "hardware"

# Phases (training.phase values).
PHASE_LOAD = "load"
PHASE_TRAIN = "train"
PHASE_EVALUATE = "evaluate"
PHASE_SAVE = "save"


# The numeric Point fields, in CSV column order (`otel-gpu analyze`) — also what the engine checks
# for NaN and infinities.
NUMERIC_FIELDS = (
    "used_bytes",
    "limit_bytes",
    "util",
    "power_w",
    "power_limit_w",
    "step",
    "temperature_c",
    "ecc_uncorrected",
    "xid_errors",
)


@dataclass(slots=True)
class Point:
    """One observation of one subject at the data's own time ``time`` (seconds).

    Any field may be ``None`` (unknown). ``used_bytes`` is the memory series the leak detector
    watches (a device's memory, one process's GPU memory, torch allocated bytes or host RSS);
    the rest describe activity for the stall and threshold detectors.

    Treat a Point as a value: the engine never changes or keeps one. It is not frozen only
    because a frozen dataclass costs ~1.5 us more to build, and the processor builds one per
    subject per collection (it was never hashable: ``extra`` is a dict).
    """

    time: float
    used_bytes: float | None = None
    limit_bytes: float | None = None
    util: float | None = None  # 0..1
    procs: int | None = None  # processes holding the GPU
    phase: str | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    step: float | None = None  # global training step
    temperature_c: float | None = None
    ecc_uncorrected: float | None = None  # cumulative count
    xid_errors: float | None = None  # cumulative count
    extra: dict[str, float] = field(default_factory=dict)  # other metrics for anomaly bands


@dataclass(frozen=True, slots=True)
class Alert:
    """One finding. ``subject`` names what it is about (a GPU, a process, a job)."""

    kind: str
    subject: str
    time: float  # data time of the point that raised it
    severity: str  # "warning" | "critical"
    message: str  # one human sentence
    rate_bytes_per_s: float | None = None
    eta_s: float | None = None  # projected seconds until the limit is reached
    window_s: float | None = None  # evidence window
    confidence: float | None = None  # 0..1
    evidence: dict[str, float | str] = field(default_factory=dict)
