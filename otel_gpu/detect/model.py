"""Data the detection engine takes in and gives out. Pure data, no I/O."""

from __future__ import annotations

import itertools
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# Alert kinds (contract: `otel-gpu analyze` prints these).
LEAK = "leak"
STALL = "stall"
THRESHOLD = "threshold"
ANOMALY = "anomaly"
HARDWARE = "hardware"
# A GPU process the job started that is still holding GPU memory after the job ended (raised
# by the wrapper at the job's end, not by the engine: agent/leftovers.py).
ORPHAN = "orphan"

# Phases (training.phase values).
PHASE_LOAD = "load"
PHASE_TRAIN = "train"
PHASE_EVALUATE = "evaluate"
PHASE_SAVE = "save"
# The names people give phases (spans, CSV columns, metric attributes), lower case, each
# to one of the four above; read through :func:`canonical_phase` wherever a phase is read.
PHASE_ALIASES = {
    "load": PHASE_LOAD,
    "load_model": PHASE_LOAD,
    "load_data": PHASE_LOAD,
    "loading": PHASE_LOAD,
    "train": PHASE_TRAIN,
    "training": PHASE_TRAIN,
    "fit": PHASE_TRAIN,
    "evaluate": PHASE_EVALUATE,
    "evaluation": PHASE_EVALUATE,
    "eval": PHASE_EVALUATE,
    "validation": PHASE_EVALUATE,
    "validate": PHASE_EVALUATE,
    "val": PHASE_EVALUATE,
    "test": PHASE_EVALUATE,
    "save": PHASE_SAVE,
    "save_checkpoint": PHASE_SAVE,
    "checkpoint": PHASE_SAVE,
    "checkpointing": PHASE_SAVE,
}


def canonical_phase(name: str | None) -> str | None:
    """``name`` as one of the four phases when it is a known alias (any case), else as is."""
    if name is None:
        return None
    return PHASE_ALIASES.get(name) or PHASE_ALIASES.get(name.strip().lower(), name)


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


def point(time: float, values: Mapping[str, Any]) -> Point:
    """A Point at data time ``time`` (s) from field values by name: how the agent and the CSV
    reader build one (a name that is no Point field raises TypeError)."""
    return Point(time=time, **values)


# Point's value fields in declaration order, the layout of a row (:func:`point_from_row`): every
# field after ``time`` up to the first one with a default factory (``extra``).
ROW_FIELDS = tuple(
    itertools.takewhile(
        lambda name: Point.__dataclass_fields__[name].default_factory is MISSING,
        (f.name for f in fields(Point)[1:]),
    )
)


def point_from_row(time: float, row: Sequence[Any]) -> Point:
    """A Point from one value per :data:`ROW_FIELDS` name, in that order: how the processor
    builds one per subject per collection, where a keyword call would cost ~0.5 us more."""
    return Point(time, *row)


def _numeric_fields() -> tuple[str, ...]:
    hints = typing.get_type_hints(Point)
    return tuple(f.name for f in fields(Point) if hints[f.name] == float | None)


# The numeric (float) Point fields, in declaration order: the engine's NaN and infinity guard and
# the CSV columns of `otel-gpu analyze`, read off Point itself so that a new field cannot be left
# out of either.
NUMERIC_FIELDS = _numeric_fields()


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Where and why: what attribution found for an alert's subject (the holders of leaked
    memory, the rank and frame a hang sits in, the collective a rank never joined).

    Produced by :mod:`otel_gpu.diagnose` outside the engine (it reads the job's processes) and
    attached to an :class:`Alert` before actions run; every output carries it. ``lines`` are
    human text, most telling first (notifiers show the first three); ``data`` is the same as
    JSON-able structure (``--summary-json``, ``--record``, ``diagnose --json``). Neither holds a
    tensor's values, and both pass redaction before they leave the machine.
    """

    kind: str  # "memory" | "stall" | ... : which diagnosis ran
    lines: tuple[str, ...]
    data: Mapping[str, Any] = field(default_factory=dict)
    took_s: float | None = None  # wall time the diagnosis took
    error: str | None = None  # why it found nothing, when it could not look

    def shown(self, n: int = 3) -> list[str]:
        """The first ``n`` lines a person reads, or the one line saying why there are none."""
        if self.lines:
            return list(self.lines[:n])
        return [f"no diagnosis: {self.error}"] if self.error else []


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
    diagnosis: Diagnosis | None = None  # attached by the agent, not by the engine


def alert_from_dict(record: Mapping[str, Any]) -> Alert:
    """The :class:`Alert` that ``dataclasses.asdict`` turned into ``record`` (saved state); an
    unknown key raises TypeError."""
    values = dict(record)
    found = values.get("diagnosis")
    if isinstance(found, Mapping):
        values["diagnosis"] = Diagnosis(**{**found, "lines": tuple(found.get("lines", ()))})
    return Alert(**values)
