"""Checklist 37, data-model violations: each one is refused (counted, reported in
``partial_success``, cut from the forwarded copy) or forwarded but never judged, as the table in
docs/processor.md says; unknown fields (a newer OTLP) pass through."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from support.processor import in_process_config
from support.strict_downstream import StrictDownstream
from support.synth import agent_request, default_value

from otel_gpu.detect.model import Point
from otel_gpu.processor import Downstream, Processor
from otel_gpu.processor.assemble import Assembler, Subject
from otel_gpu.processor.decode import MetricsDecoder, strip_rejected
from otel_gpu.processor.wire import METRICS_EXPORT

NOW = time.time()
T0 = int((NOW - 3600) * 1e9)
STEP = 15_000_000_000  # ns between collections
UNKNOWN_FIELD = b"\xfa\x3f\x07future!"  # field 1023, length-delimited: no OTLP version has it


def metric(req: ExportMetricsServiceRequest, name: str, index: int = 0) -> Metric:
    """The ``index``-th metric called ``name`` (hw.errors has one per error.type)."""
    found = [m for m in req.resource_metrics[0].scope_metrics[0].metrics if m.name == name]
    return found[index]


def ecc_metric(req: ExportMetricsServiceRequest) -> Metric:
    """hw.errors: one Sum with a point per error.type (corrected, uncorrected, xid)."""
    return metric(req, "hw.errors")


def gpu_request(
    k: int, ecc: float = 0.0, start_ns: int | None = None
) -> ExportMetricsServiceRequest:
    def value(name: str, index: int, extra: dict[str, str]) -> float | None:
        if name == "hw.errors" and extra.get("error.type") == "uncorrected":
            return ecc
        return default_value(name, index, extra)

    return agent_request(T0 + k * STEP, gpus=1, processes=0, value=value, start_ns=start_ns)


def decode(*requests: ExportMetricsServiceRequest) -> tuple[list[Any], list[Point]]:
    """Each request's Decoded, and the GPU points the detectors got (after a final flush)."""
    out: list[tuple[Subject, Point]] = []
    asm = Assembler(lambda s, p: out.append((s, p)), 100, 1.0, 3600.0)
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    results = [dec.decode(r.SerializeToString(), asm, int(NOW * 1e9)) for r in requests]
    asm.flush_due(NOW, all_pending=True)
    return results, [p for s, p in out if s.kind == "gpu"]


def set_power(value: float) -> Callable[[ExportMetricsServiceRequest], None]:
    def mutate(req: ExportMetricsServiceRequest) -> None:
        metric(req, "hw.power").gauge.data_points[0].as_double = value

    return mutate


def set_time(field: str, ns: int) -> Callable[[ExportMetricsServiceRequest], None]:
    def mutate(req: ExportMetricsServiceRequest) -> None:
        setattr(metric(req, "hw.temperature").gauge.data_points[0], field, ns)

    return mutate


def unknown_temporality(req: ExportMetricsServiceRequest) -> None:
    ecc_metric(req).sum.aggregation_temporality = 7  # type: ignore[assignment]


def unknown_point_field(req: ExportMetricsServiceRequest) -> None:
    metric(req, "hw.power").gauge.data_points[0].MergeFromString(UNKNOWN_FIELD)


# (case, mutation of one collection, rejected points, ignored points, message part, the GPU
# point's field the detectors must (not) get, its expected value: None = not judged)
SINGLE = [
    ("NaN value", set_power(math.nan), 1, 0, "not a finite number", "power_w", None),
    ("infinite value", set_power(-math.inf), 1, 0, "not a finite number", "power_w", None),
    ("no timestamp", set_time("time_unix_nano", 0), 1, 0, "outside", "temperature_c", None),
    (
        "start after time",
        set_time("start_time_unix_nano", T0 + 1),
        1,
        0,
        "start time",
        "temperature_c",
        None,
    ),
    ("unknown temporality", unknown_temporality, 0, 3, "", "ecc_uncorrected", None),
    ("unknown field in a point", unknown_point_field, 0, 0, "", "power_w", 610.0),
    ("untouched", lambda req: None, 0, 0, "", "power_w", 610.0),
]


@pytest.mark.unit
@pytest.mark.parametrize(
    "mutate,rejected,ignored,message,fld,expected",
    [c[1:] for c in SINGLE],
    ids=[c[0] for c in SINGLE],
)
def test_each_violation_is_refused_or_left_unjudged(
    mutate, rejected, ignored, message, fld, expected
):
    req = gpu_request(0)
    mutate(req)
    (decoded,), (point,) = decode(req)
    assert (decoded.rejected, decoded.ignored) == (rejected, ignored)
    assert message in decoded.first_error
    assert getattr(point, fld) == expected
    assert point.used_bytes is not None  # the rest of the collection is judged


# (case, ECC count in the second collection, whether it starts a new series, ignored, judged)
COUNTER = [
    ("counter going down", 3.0, False, 1, None),
    ("counter reset with a new start time", 3.0, True, 0, 3.0),
    ("counter going up", 9.0, False, 0, 9.0),
]


@pytest.mark.unit
@pytest.mark.parametrize(
    "second,restart,ignored,judged", [c[1:] for c in COUNTER], ids=[c[0] for c in COUNTER]
)
def test_a_monotonic_cumulative_sum_that_decreases_is_not_judged(second, restart, ignored, judged):
    start = T0 - 10**12
    first = gpu_request(0, ecc=5.0, start_ns=start)
    later = gpu_request(1, ecc=second, start_ns=T0 + STEP - 1 if restart else start)
    results, points = decode(first, later)
    assert [r.ignored for r in results] == [0, ignored]
    assert [r.rejected for r in results] == [0, 0]  # valid on the wire: forwarded
    assert [p.ecc_uncorrected for p in points] == [5.0, judged]


@pytest.mark.unit
def test_rejected_points_are_cut_but_unknown_fields_are_kept_in_the_forwarded_copy():
    req = gpu_request(0)
    unknown_point_field(req)
    set_time("time_unix_nano", 0)(req)
    raw = req.SerializeToString()
    (decoded,), _ = decode(req)
    cleaned = strip_rejected(raw, decoded.bad)
    assert UNKNOWN_FIELD in cleaned
    again = ExportMetricsServiceRequest.FromString(cleaned)
    assert len(metric(again, "hw.temperature").gauge.data_points) == 0
    assert len(metric(again, "hw.power").gauge.data_points) == 1


def add_histogram(req: ExportMetricsServiceRequest, name: str, bounds, counts, count) -> None:
    m = req.resource_metrics[0].scope_metrics[0].metrics.add(name=name)
    m.histogram.aggregation_temporality = 2  # type: ignore[assignment]
    dp = m.histogram.data_points.add(time_unix_nano=T0, count=count, sum=1.0)
    dp.explicit_bounds.extend(bounds)
    dp.bucket_counts.extend(counts)


@pytest.fixture
def processor() -> Iterator[tuple[Processor, StrictDownstream]]:
    down = StrictDownstream()
    p = Processor(in_process_config(forward=(Downstream(down.address),)))
    try:
        yield p, down
    finally:
        p.stop(5)
        down.close()


@pytest.mark.process
def test_inconsistent_histograms_are_refused_in_partial_success_and_the_rest_forwarded(processor):
    p, down = processor
    req = gpu_request(0)
    add_histogram(req, "latency.good", [1.0, 2.0], [1, 2, 3], 6)
    add_histogram(req, "latency.count_mismatch", [1.0, 2.0], [1, 2, 3], 7)
    add_histogram(req, "latency.unsorted", [2.0, 1.0], [1, 2, 3], 6)
    add_histogram(req, "latency.nan_bound", [1.0, math.nan], [1, 2, 3], 6)
    add_histogram(req, "latency.bucket_number", [1.0, 2.0], [1, 2], 3)
    add_histogram(req, "latency.no_buckets", [], [], 4)  # count and sum only: valid
    unknown_point_field(req)
    reply = ExportMetricsServiceResponse.FromString(
        p.export_metrics(METRICS_EXPORT, req.SerializeToString())
    )
    assert reply.partial_success.rejected_data_points == 4
    assert "latency.count_mismatch: bucket counts add up to 6, not to count 7" in (
        reply.partial_success.error_message
    )
    assert down.wait_for(lambda: len(down.requests) == 1)
    (got,) = down.requests
    points = {
        m.name: len(m.histogram.data_points)
        for m in got.resource_metrics[0].scope_metrics[0].metrics
        if m.name.startswith("latency.")
    }
    assert points == {
        "latency.good": 1,
        "latency.count_mismatch": 0,
        "latency.unsorted": 0,
        "latency.nan_bound": 0,
        "latency.bucket_number": 0,
        "latency.no_buckets": 1,
    }
    assert UNKNOWN_FIELD in got.SerializeToString()  # forward compatibility
    assert p.stats()["rejected_requests"] == 1


@pytest.mark.process
def test_a_request_with_unknown_fields_only_is_forwarded_as_received(processor):
    p, down = processor
    raw = gpu_request(0).SerializeToString() + UNKNOWN_FIELD  # a newer top-level field
    assert p.export_metrics(METRICS_EXPORT, raw) == b""  # all accepted
    assert down.wait_for(lambda: len(down.requests) == 1)
    assert down.requests[0].SerializeToString().endswith(UNKNOWN_FIELD)
    assert p.stats()["detection"]["points"] > 0
