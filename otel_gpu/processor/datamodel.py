"""What a fully parsed export request holds, and the OTLP data-model checks on it that the
wire format cannot express.

The decoder judges the points of the series the detectors read (see decode.py); this module
judges the points every downstream would misread whatever their metric: a Histogram whose
bucket counts do not add up to its ``count``, whose bucket count is not one more than its
explicit bounds, or whose bounds are not strictly increasing. Quantiles computed from such a
point are wrong without any sign of it, so the processor refuses the point (``partial_success``)
and forwards the rest of the request.
"""

from __future__ import annotations

from typing import Any

from otel_gpu.processor.wire import METRICS_EXPORT, TRACE_EXPORT

Index = tuple[int, int, int, int]  # (resource_metrics, scope_metrics, metric, data_point)


def histogram_problem(dp: Any) -> str:
    """Why one HistogramDataPoint is inconsistent, or "" when it is not."""
    bounds = dp.explicit_bounds
    # `not a < b` also refuses NaN bounds.
    if any(not a < b for a, b in zip(bounds, bounds[1:], strict=False)):
        return "explicit bounds are not strictly increasing"
    counts = dp.bucket_counts
    if not counts:
        return ""  # count and sum only: allowed
    if len(counts) != len(bounds) + 1:
        return f"{len(counts)} bucket counts for {len(bounds)} bounds (expected bounds + 1)"
    if sum(counts) != dp.count:
        return f"bucket counts add up to {sum(counts)}, not to count {dp.count}"
    return ""


def histogram_violations(req: Any) -> tuple[list[Index], str]:
    """Indexes of the inconsistent Histogram points of a parsed ExportMetricsServiceRequest,
    and a message naming the first."""
    bad: list[Index] = []
    first = ""
    for ri, rm in enumerate(req.resource_metrics):
        for si, sm in enumerate(rm.scope_metrics):
            for mi, m in enumerate(sm.metrics):
                if m.WhichOneof("data") != "histogram":
                    continue
                for di, dp in enumerate(m.histogram.data_points):
                    why = histogram_problem(dp)
                    if why:
                        bad.append((ri, si, mi, di))
                        first = first or f"{m.name}: {why}"
    return bad, first


def count_items(method: str, req: Any) -> int:
    """Data points, spans or log records in a parsed export request."""
    if method == METRICS_EXPORT:
        n = 0
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind is not None:
                        n += len(getattr(m, kind).data_points)
        return n
    if method == TRACE_EXPORT:
        return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return sum(len(sl.log_records) for rl in req.resource_logs for sl in rl.scope_logs)
