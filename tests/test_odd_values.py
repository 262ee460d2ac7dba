"""Odd readings from NVML (RELIABILITY B, cases 16-21) through the real pynvml path on the C
fake: each is skipped, clamped or given a new start time as documented in odd_values.py and
docs/metrics.md, never exported as a wrong number."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu.agent import instruments as metrics
from otel_gpu.sampling.snapshot import Snapshot

pytestmark = pytest.mark.unit

UUID = "GPU-fa4e0000-0000-4000-8000-{:012x}"


def gpu0(reading):
    (g,) = [g for g in reading.gpus if g.index == 0]
    return g


def proc(pid):
    return lambda r: next(
        (p.used_memory, p.sm_util, p.mem_util) for p in r.gpu_processes if p.pid == pid
    )


CASES = [
    # (case, scenario for GPU 0, what to read, expected)
    ("used>total: clamped", "memory.total = 1000\nmemory.used = 1500\nmemory.reserved = 0",
     lambda r: (gpu0(r).memory_used, gpu0(r).memory_total), (1000, 1000)),
    ("v2 used+reserved>total: clamped", "memory.total = 1000\nmemory.used = 1200\nmemory.reserved = 300",
     lambda r: (gpu0(r).memory_used, gpu0(r).memory_reserved), (1000, 300)),
    ("total 0: unknown", "memory.total = 0\nmemory.used = 0",
     lambda r: gpu0(r).memory_total, None),
    ("util 100: kept", "util.gpu = 100", lambda r: gpu0(r).util_gpu, 1.0),
    ("util 101: unknown", "util.gpu = 101\nutil.memory = 41",
     lambda r: (gpu0(r).util_gpu, gpu0(r).util_memory), (None, 0.41)),
    ("memory util 250: unknown", "util.memory = 250", lambda r: gpu0(r).util_memory, None),
    ("encoder all ones: unknown", "util.encoder = 4294967295", lambda r: gpu0(r).util_encoder, None),
    ("temperature 66: kept", "temperature = 66", lambda r: gpu0(r).temperature_c, 66.0),
    ("temperature 0: unknown", "temperature = 0", lambda r: gpu0(r).temperature_c, None),
    ("temperature 255: unknown", "temperature = 255", lambda r: gpu0(r).temperature_c, None),
    ("process memory > device: unknown", "memory.total = 1000\nmemory.used = 10\nprocesses = 42:5000 43:500",
     lambda r: (proc(42)(r)[0], proc(43)(r)[0]), (None, 500)),
    ("process memory 0: kept", "processes = 42:0", lambda r: proc(42)(r)[0], 0),
    ("process util 150: left out", "processes = 42:1\nprocess_util = 42:150:20",
     proc(42), (1, None, 0.2)),
    ("process util from the future: ignored",
     "processes = 42:1\nprocess_util = 42:50:20\nprocess_util.offset_ms = 3600000",
     proc(42), (1, None, None)),
    ("name not UTF-8: replaced", r"name = \xff\xfeBoard", lambda r: gpu0(r).name, "\ufffd\ufffdBoard"),
    ("name with escape sequences: removed whole", r"name = \x1b[31mRed\x07", lambda r: gpu0(r).name, "Red"),
    ("name empty: no hw.name", "name = ", lambda r: gpu0(r).name, None),
    ("name of 80 characters: cut to 64", "name = " + "N" * 80, lambda r: gpu0(r).name, "N" * 64),
    ("name past NVML's buffer: unknown", "name = " + "N" * 120, lambda r: gpu0(r).name, None),
    ("duplicate names: both kept", "name = Twin\ngpu.1.name = Twin",
     lambda r: [g.name for g in r.gpus], ["Twin", "Twin"]),
    ("UUID not UTF-8: not watched", r"uuid = GPU-\xff\xfe", lambda r: [g.uuid for g in r.gpus], [UUID.format(1)]),
    ("UUID empty: not watched", "uuid = ", lambda r: [g.uuid for g in r.gpus], [UUID.format(1)]),
    ("UUID with a space: not watched", "uuid = GPU 0", lambda r: [g.uuid for g in r.gpus], [UUID.format(1)]),
    ("UUID of another GPU: the later one not watched", f"gpu.1.uuid = {UUID.format(0)}",
     lambda r: [(g.index, g.uuid) for g in r.gpus], [(0, UUID.format(0))]),
    ("MIG UUID of another GPU's MIG device: not watched",
     "mig = 1\nmig.0.0.uuid = MIG-dup\ngpu.1.mig = 1\nmig.1.0.uuid = MIG-dup",
     lambda r: [g.uuid for g in r.gpus], [UUID.format(0), "MIG-dup", UUID.format(1)]),
]  # fmt: skip


@pytest.mark.parametrize(
    "scenario, read, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_odd_reading(fake_nvml: FakeNvml, scenario: str, read: Any, expected: Any):
    lines = [ln if ln[:4] in ("gpu.", "mig.") else f"gpu.0.{ln}" for ln in scenario.splitlines()]
    fake_nvml.write("devices = 2\n" + "\n".join(lines))
    assert read(fake_nvml.source().sample([])) == expected


def test_an_odd_reading_is_logged_once_per_device_and_metric(fake_nvml: FakeNvml, caplog):
    caplog.set_level(logging.WARNING, logger="otel_gpu.nvml")
    fake_nvml.write("devices = 1\ngpu.0.temperature = 255")
    src = fake_nvml.source()
    for _ in range(3):
        assert gpu0(src.sample([])).temperature_c is None
    odd = [r for r in caplog.records if "odd temperature" in r.getMessage()]
    assert len(odd) == 1 and "255" in odd[0].getMessage()


def test_a_future_sample_stamp_does_not_blind_process_utilization(fake_nvml: FakeNvml):
    """A sample stamped an hour ahead is ignored and does not become the last-seen stamp, so
    the next correctly stamped sample is read (NVML would answer NOT_FOUND until then)."""
    base = "devices = 1\ngpu.0.processes = 42:1\ngpu.0.process_util = 42:50:20\n"
    fake_nvml.write(base + "gpu.0.process_util.offset_ms = 3600000")
    src = fake_nvml.source()
    assert [p.sm_util for p in src.sample([]).gpu_processes] == [None]
    fake_nvml.write(base)  # the clock is right again
    assert [p.sm_util for p in src.sample([]).gpu_processes] == [0.5]


def collect(reader: InMemoryMetricReader) -> dict[tuple[str, str], Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        (m.name, p.attributes.get("error.type", "")): p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    }


def test_memory_over_total_is_exported_as_a_full_gpu(fake_nvml: FakeNvml):
    fake_nvml.write("devices = 1\ngpu.0.memory.total = 1000\ngpu.0.memory.used = 4000")
    src = fake_nvml.source()
    reader = InMemoryMetricReader()
    metrics.register(
        MeterProvider(metric_readers=[reader]).get_meter("t"),
        lambda: Snapshot(time=time.time(), gpus=src.sample([]).gpus),
    )
    got = collect(reader)
    assert got[("hw.gpu.memory.usage", "")].value == 1000
    assert got[("hw.gpu.memory.utilization", "")].value == 1.0


def test_counters_that_go_backwards_after_a_driver_reload_start_a_new_series(fake_nvml: FakeNvml):
    """Energy and volatile ECC counts restart at a driver reload. The SDK would export the lower
    value under the old start time (a cumulative sum that decreases); the agent starts a new
    series instead: the lower value with a later start time. Increases keep the start time."""
    fake_nvml.write("devices = 1\ngpu.0.energy = 5000000\ngpu.0.ecc.corrected = 7")
    src = fake_nvml.source(slow_period_s=0.0)  # ECC counts are slow metrics: read every sweep
    reader = InMemoryMetricReader()
    metrics.register(
        MeterProvider(metric_readers=[reader]).get_meter("t"),
        lambda: Snapshot(time=time.time(), gpus=src.sample([]).gpus),
    )
    first = collect(reader)
    fake_nvml.write("devices = 1\ngpu.0.energy = 6000000\ngpu.0.ecc.corrected = 9")
    grown = collect(reader)
    fake_nvml.write("devices = 1\ngpu.0.energy = 1000\ngpu.0.ecc.corrected = 0")  # reload
    restarted = collect(reader)
    fake_nvml.write("devices = 1\ngpu.0.energy = 2000\ngpu.0.ecc.corrected = 1")
    after = collect(reader)
    for key, values in (
        (("hw.energy", ""), (5000, 6000, 1, 2)),
        (("hw.errors", "corrected"), (7, 9, 0, 1)),
    ):
        points = [first[key], grown[key], restarted[key], after[key]]
        assert [p.value for p in points] == list(values), key
        starts = [p.start_time_unix_nano for p in points]
        assert starts[0] == starts[1] < starts[2] == starts[3], key
        assert starts[2] > first[key].time_unix_nano  # the new series starts after the old one
