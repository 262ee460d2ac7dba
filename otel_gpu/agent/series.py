"""Forgetting series that ended: exited processes, removed GPUs, counters that started again.

Why this exists. The OTel Python SDK (read on 1.45; the same since 1.2x) keeps one aggregation
per attribute set of an asynchronous instrument, per reader, for the life of the MeterProvider
(``_ViewInstrumentMatch._attributes_aggregation``); only synchronous instruments under delta
temporality are emptied at collection. An attribute set that a callback stops observing is no
longer exported (its value is cleared at each collection), but it keeps its slot: it counts
against the cardinality limit (2,000 per instrument by default) and its memory is never freed.
A job whose DataLoader workers are spawned again every epoch fills the limit after about 2,000
PIDs; from then on every new process is reported only under ``otel.metric.overflow=true``.

Other ways out, and why not: a View raising ``aggregation_cardinality_limit`` only postpones the
overflow while memory keeps growing; Views need the MeterProvider to be built here, and in
process under ``opentelemetry-instrument`` the agent registers on the application's provider;
delta temporality does not empty asynchronous instruments. The callbacks, though, know exactly
which series are alive (those of the latest snapshot). So each instrument remembers what it
reported last; when a series it reported before is gone, every reader's storage of that
instrument drops the aggregations of the attribute sets not observed now. Live series keep
their aggregation, so their start time stays. The same hook gives a monotonic counter that went
backwards (a driver reload restarts the energy and ECC counters) a new start time: its
aggregation is dropped before the observation, and the SDK starts a new one, stamped now,
instead of exporting a cumulative sum that decreases under the old start time.

This reaches into SDK internals (``_storage_tables``); where they are missing (another SDK
layout, a no-op or proxy meter) forgetting is off, one warning says so, and metrics flow as
before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import Observation

log = logging.getLogger("otel_gpu.metrics")

Key = frozenset[tuple[str, Any]]  # an attribute set, compared by value


def _key(attrs: Mapping[str, Any] | None, only: Iterable[str] | None = None) -> Key:
    """A hashable identity of an attribute set (``only``: the keys a View keeps)."""
    if not attrs:
        return frozenset()
    if only is None:
        return frozenset(attrs.items())
    return frozenset((k, v) for k, v in attrs.items() if k in only)


class SeriesBook:
    """The series one observable instrument reported last, and the SDK state it may drop."""

    def __init__(self, name: str, monotonic: bool = False) -> None:
        self.name = name
        self.monotonic = monotonic  # a Counter: a lower value than last time is a restart
        self.instrument: Any = None  # set once the SDK instrument exists
        # What the last call reported: the ids of its attribute dicts (the table's dicts are
        # shared and cached, so a live series has the same dict every time) and the
        # observations themselves, held so that those ids stay unique.
        self._ids: list[int] = []
        self._held: Sequence[Observation] = ()
        self._totals: dict[int, float] = {}  # monotonic: last value per attribute dict id
        self._off = False

    def observe(self, observations: Sequence[Observation]) -> None:
        """Called by the callback with what it returns; drops what ended. Never raises.

        Not locked: the SDK runs one collection at a time per MeterProvider (its measurement
        consumer holds a lock through every callback), so the calls for one instrument come one
        after the other, each with a snapshot at least as new as the last."""
        ids = [id(o.attributes) for o in observations]
        restarted: list[Mapping[str, Any]] = []
        if self.monotonic:
            totals = self._totals
            for i, o in zip(ids, observations, strict=True):
                before = totals.get(i)
                if before is not None and o.value < before:
                    restarted.append(o.attributes or {})
            self._totals = {i: o.value for i, o in zip(ids, observations, strict=True)}
        gone = ids != self._ids and not set(ids).issuperset(self._ids)
        self._ids, self._held = ids, observations
        if (gone or restarted) and not self._off and self.instrument is not None:
            try:
                self._forget([o.attributes or {} for o in observations], restarted)
            except Exception as exc:  # an SDK without these internals: forgetting is off
                self._off = True
                log.warning(
                    "%s: cannot drop ended series from this OpenTelemetry SDK (%r); series of "
                    "exited processes will count against its cardinality limit",
                    self.name,
                    exc,
                )

    def _forget(
        self, live: Sequence[Mapping[str, Any]], restarted: Sequence[Mapping[str, Any]]
    ) -> None:
        for table, lock, only in _storage_tables(self.instrument):
            keep = {_key(a, only) for a in live} - {_key(a, only) for a in restarted}
            with lock:
                ended = [k for k, agg in table.items() if _key(agg._attributes) not in keep]
                for k in ended:
                    del table[k]


def _storage_tables(instrument: Any) -> Iterable[tuple[dict[Any, Any], Any, Any]]:
    """(per-attribute-set aggregations, their lock, the View's attribute keys) of every reader
    and View of ``instrument``. SDK internals: raises AttributeError where they differ."""
    storages = instrument._measurement_consumer._reader_storages
    for storage in list(storages.values()):
        for match in storage._instrument_view_instrument_matches.get(instrument, ()):
            yield match._attributes_aggregation, match._lock, match._view._attribute_keys
