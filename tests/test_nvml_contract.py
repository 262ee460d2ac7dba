"""Every sample field the agent's instruments read is produced by the real sources: NvmlSource
through the real pynvml on the C fake of libnvidia-ml (tests/fakenvml), in a scenario where the
GPU supports every metric, and ProcessTree on a real child process's /proc.

So an NVML metric added to the instrument table whose read was forgotten (no row in
``sampling/nvml_api.py``, no read in ``sampling/nvml.py``) fails here: the field stays None on
every sweep and the metric would never be exported.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import instruments
from otel_gpu.sampling.procs import ProcessTree
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

pytestmark = pytest.mark.process

GIB = 1 << 30
# A GPU that answers every call the agent makes (not in MIG mode: a MIG GPU has no engine
# utilization), with an Xid event pending and the watched process on it.
EVERYTHING = """
devices = 1
gpu.0.memory.total = 85899345920
gpu.0.memory.used = 10000000000
gpu.0.memory.reserved = 500000000
gpu.0.util.gpu = 87
gpu.0.util.memory = 41
gpu.0.util.encoder = 12
gpu.0.util.decoder = 7
gpu.0.temperature = 66
gpu.0.power.usage = 312500
gpu.0.power.limit = 400000
gpu.0.energy = 5000000+300000/s
gpu.0.clock.sm = 1395
gpu.0.clock.mem = 1593
gpu.0.pcie.tx = 2048
gpu.0.pcie.rx = 1000
gpu.0.ecc.corrected = 3
gpu.0.ecc.uncorrected = 1
gpu.0.clocks_event_reasons = 0x24
gpu.0.xid = 13
gpu.0.processes = {pid}:1073741824
gpu.0.process_util = {pid}:50:20
"""


@pytest.fixture
def swept(fake_nvml: FakeNvml) -> Iterator[Snapshot]:
    """The second sweep (rates and CPU time need two) of a real child process on the fake."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fake_nvml.write(EVERYTHING.format(pid=child.pid))
        sampler = Sampler(fake_nvml.source(), ProcessTree([child.pid]), interval_s=1.0)
        sampler.sweep()
        snap = sampler.sweep()
        assert snap.no_gpu_reason is None and len(snap.gpus) == 1
        assert [p.pid for p in snap.processes] == [child.pid]
        assert [p.pid for p in snap.gpu_processes] == [child.pid]
        yield snap
    finally:
        child.kill()
        child.wait(5)


def _records(snap: Snapshot) -> dict[type, Any]:
    return {
        GpuSample: snap.gpus[0],
        GpuProcessSample: snap.gpu_processes[0],
        ProcessSample: snap.processes[0],
    }


def _read_fields() -> list[tuple[str, str]]:
    """(instrument, sample field) of every field an instrument copies from a sample."""
    return [(spec.name, field) for spec in instruments.INSTRUMENTS for field, _ in spec.sources]


def test_the_instrument_table_names_sample_fields() -> None:
    fields = {
        *(f.name for f in dataclasses.fields(GpuSample)),
        *GpuProcessSample._fields,
        *ProcessSample._fields,
    }
    assert _read_fields() and {field for _, field in _read_fields()} <= fields


def test_every_field_an_instrument_reads_is_produced_by_the_sources(swept: Snapshot) -> None:
    records = _records(swept)
    missing = [
        (name, field)
        for name, field in _read_fields()
        if all(getattr(r, field, None) is None for r in records.values())
    ]
    assert missing == [], "read by an instrument, never produced by NVML or /proc"


def test_every_instrument_exports_every_series_from_a_real_sweep(swept: Snapshot) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instruments.register(provider.get_meter("t"), lambda: swept)
    data = reader.get_metrics_data()
    provider.shutdown()
    points = {
        m.name: [dict(p.attributes) for p in m.data.data_points]
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    for spec in instruments.INSTRUMENTS:
        assert points.get(spec.name), f"{spec.name}: no point from a real sweep"
        for field, extra in spec.sources:
            wanted = dict(extra)
            assert any(wanted.items() <= attrs.items() for attrs in points[spec.name]), (
                f"{spec.name}: no series {wanted} (sample field {field})"
            )
