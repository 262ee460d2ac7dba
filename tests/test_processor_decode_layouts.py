"""The decoder reads data points in any valid wire layout, not only the one SDKs write.

Most points are read in place (fixed-width time and value, then the attributes as a cache
key); any other layout must be parsed in full and give the same result, and malformed points
must still fail the request.
"""

from __future__ import annotations

import math
import struct

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_gpu.processor.decode import MetricsDecoder

pytestmark = pytest.mark.unit

T = 1_700_000_000 * 10**9


class _Sink:
    generation = 0
    overflow = 0

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    def target(self, res, kind, hw_id, pid, fld):  # type: ignore[no-untyped-def]
        return f"{kind}|{hw_id}|{pid}|{fld}"

    def put(self, tg, t, v):  # type: ignore[no-untyped-def]
        self.calls.append((tg, t, v))

    def put_job(self, res, t, fld, v):  # type: ignore[no-untyped-def]
        raise AssertionError("no job series here")


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([b])
        out += bytes([b | 0x80])


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _fixed(field: int, fmt: str, v: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack(fmt, v)


def _kv(k: str, v: str) -> bytes:
    return _ld(7, KeyValue(key=k, value=AnyValue(string_value=v)).SerializeToString())


ATTRS = _kv("hw.id", "GPU-1") + _kv("hw.gpu.task", "general")
TIME = _fixed(3, "<Q", T)
VALUE = _fixed(4, "<d", 0.5)


def _decode(point: bytes) -> tuple[list[tuple[str, int, float]], int, str]:
    res = _ld(
        1, _ld(1, KeyValue(key="host.name", value=AnyValue(string_value="h")).SerializeToString())
    )
    metric = _ld(1, b"hw.gpu.utilization") + _ld(5, _ld(1, point) + _ld(1, point))
    raw = _ld(1, res + _ld(2, _ld(2, metric)))
    sink = _Sink()
    dec = MetricsDecoder(946_684_800.0, 3600.0)
    first = dec.decode(raw, sink, T + 10**9)
    second = dec.decode(raw, sink, T + 10**9)  # cached attribute sets this time
    assert (first.points, first.rejected) == (second.points, second.rejected)
    return sink.calls, first.rejected, first.first_error


CANONICAL = [("gpu|GPU-1|None|2", T, 0.5)] * 4

LAYOUTS = {
    "as SDKs write it": (_fixed(2, "<Q", T - 10**12) + TIME + VALUE + ATTRS, CANONICAL),
    "no start time": (TIME + VALUE + ATTRS, CANONICAL),
    "fields reversed": (ATTRS + VALUE + TIME, CANONICAL),
    "unknown field first": (_varint(99 << 3) + b"\x01" + TIME + VALUE + ATTRS, CANONICAL),
    "exemplar": (TIME + VALUE + _ld(5, _fixed(3, "<d", 1.0)) + ATTRS, CANONICAL),
    "flags": (TIME + VALUE + ATTRS + _varint(8 << 3) + b"\x01", CANONICAL),
    # A repeated scalar field: the last one wins (protobuf rules), not the one read in place.
    "time repeated later": (
        TIME + VALUE + ATTRS + _fixed(3, "<Q", T + 7),
        [("gpu|GPU-1|None|2", T + 7, 0.5)] * 4,
    ),
    "value repeated later": (
        TIME + VALUE + ATTRS + _fixed(4, "<d", 0.75),
        [("gpu|GPU-1|None|2", T, 0.75)] * 4,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_decodes_to_the_same_points(name: str) -> None:
    point, expected = LAYOUTS[name]
    calls, rejected, _ = _decode(point)
    assert rejected == 0
    assert calls == expected


@pytest.mark.parametrize(
    "point, why",
    [
        (TIME + ATTRS, "no value"),
        (TIME + _fixed(4, "<d", math.nan) + ATTRS, "not a finite number"),
        (TIME + VALUE + ATTRS + _fixed(3, "<Q", 0), "outside the accepted range"),
        (b"", "outside the accepted range"),
    ],
)
def test_bad_points_are_rejected_whatever_the_layout(point: bytes, why: str) -> None:
    calls, rejected, first_error = _decode(point)
    assert (calls, rejected) == ([], 2)  # both points of the first request
    assert why in first_error


@pytest.mark.parametrize(
    "point",
    [
        TIME + b"\x21\x00\x00",  # value cut short
        TIME + VALUE + b"\x3a\x50abc",  # attribute longer than the point
        _fixed(2, "<Q", T) + TIME + VALUE + b"\x3a\x05ab",
    ],
)
def test_malformed_points_fail_the_request(point: bytes) -> None:
    with pytest.raises(DecodeError):
        _decode(point)


class _JobSink(_Sink):
    def __init__(self) -> None:
        super().__init__()
        self.job: list[tuple[int, float]] = []

    def put_job(self, res, t, fld, v):  # type: ignore[no-untyped-def]
        self.job.append((fld, v))


@pytest.mark.parametrize(("metric", "kept"), [("training.step", True), ("training.loss", False),
                                              ("training.grad_norm", False)])  # fmt: skip
def test_a_trainers_loss_and_grad_norm_never_become_its_step(metric: str, kept: bool) -> None:
    from otel_gpu.processor.decode import F_STEP

    res = _ld(
        1,
        _ld(1, KeyValue(key="service.name", value=AnyValue(string_value="t")).SerializeToString()),
    )
    point = TIME + _fixed(4, "<d", 0.25)
    raw = _ld(1, res + _ld(2, _ld(2, _ld(1, metric.encode()) + _ld(5, _ld(1, point)))))
    sink = _JobSink()
    MetricsDecoder(946_684_800.0, 3600.0).decode(raw, sink, T + 10**9)
    assert sink.job == ([(F_STEP, 0.25)] if kept else [])
