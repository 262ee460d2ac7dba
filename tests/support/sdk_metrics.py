"""What the OTel SDK's in-memory reader holds, by metric name."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


def collect(reader: InMemoryMetricReader) -> dict[str, list[tuple[float, dict[str, Any], str]]]:
    """(value, attributes, unit) of every point the reader holds, by metric name."""
    out: dict[str, list[tuple[float, dict[str, Any], str]]] = {}
    data = reader.get_metrics_data()
    if data is None:  # nothing observed at all
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    out.setdefault(m.name, []).append((p.value, dict(p.attributes), m.unit))
    return out
