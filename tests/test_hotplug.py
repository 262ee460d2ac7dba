"""Hot-plug (RELIABILITY case 6): GPUs added or removed while the agent runs are followed
without a restart, through the real pynvml path on the C fake and the real SDK."""

from __future__ import annotations

import logging
import time

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import instruments as metrics
from otel_gpu.sampling.snapshot import Snapshot

pytestmark = pytest.mark.unit

UUID = "GPU-fa4e0000-0000-4000-8000-{:012x}"
U0, U1, U2 = (UUID.format(i) for i in range(3))


def memory_usage(reader: InMemoryMetricReader) -> dict[str, tuple[int, float]]:
    """hw.id -> (gpu.index, value) of hw.gpu.memory.usage at one collection."""
    data = reader.get_metrics_data()
    return {
        p.attributes["hw.id"]: (p.attributes["gpu.index"], p.value)
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "hw.gpu.memory.usage"
        for p in m.data.data_points
    }


def test_gpus_added_and_removed_are_followed_by_uuid(fake_nvml: FakeNvml, caplog):
    """A GPU added appears at the next sweep; a GPU removed stops at once, and the GPU that
    moves into its index keeps its own UUID, values and state (a metric found unsupported
    is not asked again); no GPU at all is "no GPU" mode until one is back."""
    caplog.set_level(logging.INFO, logger="otel_gpu.nvml")
    fake_nvml.write(
        """
        devices = 2
        gpu.0.memory.used = 100
        gpu.1.memory.used = 200
        fail.nvmlDeviceGetPowerUsage.0 = NOT_SUPPORTED
        """
    )
    src = fake_nvml.source()
    reader = InMemoryMetricReader()
    metrics.register(
        MeterProvider(metric_readers=[reader]).get_meter("t"),
        lambda: Snapshot(time=time.time(), gpus=src.sample([]).gpus),
    )
    assert memory_usage(reader) == {U0: (0, 100), U1: (1, 200)}

    fake_nvml.write(
        """
        devices = 3
        gpu.0.memory.used = 100
        gpu.1.memory.used = 200
        gpu.2.memory.used = 300
        fail.nvmlDeviceGetPowerUsage.0 = NOT_SUPPORTED
        """
    )
    assert memory_usage(reader) == {U0: (0, 100), U1: (1, 200), U2: (2, 300)}

    # GPU 1 is pulled: the GPU that was index 2 is index 1 now (NVML numbers by PCI order).
    fake_nvml.write(
        f"""
        devices = 2
        gpu.0.memory.used = 100
        gpu.1.uuid = {U2}
        gpu.1.memory.used = 300
        fail.nvmlDeviceGetPowerUsage.0 = NOT_SUPPORTED
        """
    )
    assert memory_usage(reader) == {U0: (0, 100), U2: (1, 300)}
    assert memory_usage(reader) == {U0: (0, 100), U2: (1, 300)}  # U1 never comes back
    assert fake_nvml.call_count("nvmlDeviceGetPowerUsage", gpu=0) == 1  # state kept

    fake_nvml.write("devices = 0")
    reading = src.sample([])
    assert (reading.gpus, reading.no_gpu_reason) == ((), "NVML reports no GPU")
    fake_nvml.write("devices = 1\ngpu.0.memory.used = 100")
    assert memory_usage(reader) == {U0: (0, 100)}
    assert src.host_info().gpu_count == 1
    changes = [r.getMessage() for r in caplog.records if "GPU count changed" in r.getMessage()]
    assert [c.split(":")[0] for c in changes] == [
        "GPU count changed from 2 to 3",
        "GPU count changed from 3 to 2",
        "GPU count changed from 2 to 0",
        "GPU count changed from 0 to 1",
    ]


def test_a_gpu_chosen_by_index_stays_chosen_when_a_removal_renumbers_it(fake_nvml: FakeNvml):
    """CUDA_VISIBLE_DEVICES=1 names the job's GPU as the job started. Pulling GPU 0 makes NVML
    number it 0: the agent keeps watching that GPU (by UUID), not the one now at index 1."""
    fake_nvml.write("devices = 3")
    src = fake_nvml.source(visible_devices="1")
    assert [g.uuid for g in src.sample([]).gpus] == [U1]
    fake_nvml.write(f"devices = 2\ngpu.0.uuid = {U1}\ngpu.1.uuid = {U2}")
    assert [(g.index, g.uuid) for g in src.sample([]).gpus] == [(0, U1)]
