"""The agent's OTLP metrics encoder (otel_gpu/agent/encode.py): byte for byte the SDK encoder's
message, with each series' attributes encoded once across exports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from otel_gpu.agent import encode
from otel_gpu.agent.encode import MetricsEncoder, cached_otlp_exporter_class

pytestmark = pytest.mark.unit


def series(n: int) -> list[dict[str, object]]:
    return [
        {"process.pid": 100 + i, "process.command": f"python train.py --rank {i}", "hw.id": f"GPU-{i % 2}",
         "x.flag": i % 2 == 0, "x.ratio": i / 4}
        for i in range(n)
    ]  # fmt: skip


class Table:
    """Observations whose series and values a test changes between collections."""

    def __init__(self) -> None:
        self.attrs = series(6)
        self.step = 0

    def floats(self, _options: CallbackOptions) -> Iterator[Observation]:
        for i, a in enumerate(self.attrs):
            yield Observation(i * 0.5 + self.step, a)

    def ints(self, _options: CallbackOptions) -> Iterator[Observation]:
        for i, a in enumerate(self.attrs):
            yield Observation(i + 10 * self.step, a)


def provider(table: Table) -> InMemoryMetricReader:
    reader = InMemoryMetricReader()
    resource = Resource.create(
        {"service.name": "t", "host.cpus": 2, "x.on": True, "gpu.models": ("H100", "H100")}
    )
    meter = MeterProvider(metric_readers=[reader], resource=resource).get_meter("otel_gpu", "9.9")
    meter.create_observable_gauge("g", [table.floats], unit="1", description="a gauge")
    meter.create_observable_counter("c", [table.ints], unit="By")
    meter.create_observable_up_down_counter("u", [table.floats])
    meter.create_counter("sync").add(3, {"k": "v"})
    return reader


def test_the_request_is_the_sdk_encoders_byte_for_byte_across_changing_exports() -> None:
    table = Table()
    reader = provider(table)
    enc = MetricsEncoder()
    for step in range(4):
        table.step = step
        if step == 2:
            table.attrs = table.attrs[2:] + series(8)[6:]  # two series end, two begin
        data = reader.get_metrics_data()
        assert data is not None
        assert enc.encode(data).SerializeToString() == encode_metrics(data).SerializeToString()


def test_each_series_attributes_are_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    table = Table()
    reader = provider(table)
    enc = MetricsEncoder()
    monkeypatch.setattr(encode, "encode_metrics", lambda _d: pytest.fail("left to the SDK"))
    calls = []
    real = encode._any_value
    monkeypatch.setattr(encode, "_any_value", lambda v: calls.append(v) or real(v))
    enc.encode(reader.get_metrics_data())  # type: ignore[arg-type]
    first = len(calls)
    assert first > 0
    table.step = 1
    enc.encode(reader.get_metrics_data())  # type: ignore[arg-type]
    assert len(calls) == first  # nothing encoded anew: same series, new values
    table.attrs = [*table.attrs, *series(7)[6:]]
    enc.encode(reader.get_metrics_data())  # type: ignore[arg-type]
    assert len(calls) - first == 3 * 5  # one new series, five attributes, three instruments


def test_what_it_does_not_handle_goes_to_the_sdk_encoder() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("m")
    meter.create_histogram("h").record(2.5, {"k": "v"})
    meter.create_observable_gauge("tuple", [lambda _o: [Observation(1.0, {"ids": (1, 2)})]])
    data = reader.get_metrics_data()
    assert data is not None
    request = MetricsEncoder().encode(data)
    assert request.SerializeToString() == encode_metrics(data).SerializeToString()
    names = [m.name for m in request.resource_metrics[0].scope_metrics[0].metrics]
    assert names == ["h", "tuple"]


def test_the_exporter_encodes_with_it() -> None:
    cls = cached_otlp_exporter_class()
    exporter = cls(endpoint="127.0.0.1:1", insecure=True)
    try:
        table = Table()
        data = provider(table).get_metrics_data()
        assert data is not None
        assert isinstance(exporter._encoder, MetricsEncoder)
        got = exporter._translate_data(data)
        assert got.SerializeToString() == encode_metrics(data).SerializeToString()
    finally:
        exporter.shutdown(timeout_millis=100)
