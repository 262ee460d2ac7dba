"""docs/reliability.md case 41, the part the health suite leaves open: collection duration per GPU
(``otel_gpu.agent.gpu.read.duration``), so the one slow GPU in a slow sweep is named."""

from __future__ import annotations

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import selfmetrics
from otel_gpu.agent.selfmetrics import ExportHealth
from otel_gpu.sampling.sampler import Sampler

pytestmark = pytest.mark.unit

UUID = "GPU-fa4e0000-0000-4000-8000-{:012x}"


def _read_durations(reader: InMemoryMetricReader) -> dict[str, float]:
    data = reader.get_metrics_data()
    return {
        p.attributes["hw.id"]: p.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "otel_gpu.agent.gpu.read.duration"
        for p in m.data.data_points
    }


def test_collection_duration_is_reported_per_gpu(fake_nvml: FakeNvml) -> None:
    # GPU 1's power reading takes 0.25 s (a slow driver call, within the 1 s deadline).
    fake_nvml.write("devices = 3\ndelay.nvmlDeviceGetPowerUsage.1 = 250")
    sampler = Sampler(fake_nvml.source(call_timeout_s=1.0), None, interval_s=1.0)
    reader = InMemoryMetricReader()
    selfmetrics.register(
        MeterProvider(metric_readers=[reader]).get_meter("t"), sampler, ExportHealth()
    )
    sampler.sample_once()
    got = _read_durations(reader)
    assert set(got) == {UUID.format(i) for i in range(3)}
    assert got[UUID.format(1)] >= 0.25  # the slow one is named...
    assert got[UUID.format(0)] < got[UUID.format(1)]  # ...apart from the others
    assert got[UUID.format(2)] < got[UUID.format(1)]
    fake_nvml.append("fail.*.2 = GPU_IS_LOST")
    sampler.sample_once()
    assert set(_read_durations(reader)) == {UUID.format(0), UUID.format(1)}  # lost: no reading
