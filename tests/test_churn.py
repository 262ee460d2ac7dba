"""Process churn: series of exited processes stop being exported and never count against the
SDK's cardinality limit (otel_gpu/agent/series.py), through the real instrument table and SDK."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import (
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
)
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import View

from otel_gpu.agent import instruments as metrics
from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot

pytestmark = pytest.mark.unit

GPU = "GPU-fa4e0000-0000-4000-8000-000000000000"
TRAINER = 100  # lives through the whole run
WORKERS_PER_EPOCH = 50
EPOCHS = 200  # 10,000 distinct worker PIDs
NEWCOMER = 4_000_000  # a long-lived process that starts after the churn
PROCESS_METRICS = (
    "process.cpu.utilization",
    "process.memory.usage",
    "process.memory.virtual",
    "process.thread.count",
    "process.unix.file_descriptor.count",
    "process.gpu.memory.usage",
    "process.gpu.utilization",
)
DELTA = {
    cls: AggregationTemporality.DELTA
    for cls in (ObservableCounter, ObservableUpDownCounter, ObservableGauge)
}


def snapshot(t: float, pids: list[int]) -> Snapshot:
    return Snapshot(
        time=t,
        gpus=(GpuSample(uuid=GPU, index=0, memory_used=1, memory_total=2, energy_j=t),),
        gpu_processes=tuple(
            GpuProcessSample(pid=p, gpu_uuid=GPU, used_memory=1000 + p, sm_util=0.5) for p in pids
        ),
        processes=tuple(
            ProcessSample(
                pid=p,
                parent_pid=TRAINER if p != TRAINER else 1,
                executable_name="python",
                cpu_utilization=0.25,
                memory_rss=p,
                memory_virtual=2 * p,
                thread_count=4,
                fd_count=9,
            )
            for p in pids
        ),
    )


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


@pytest.mark.parametrize(
    "readers",
    [
        pytest.param([{}], id="cumulative"),
        pytest.param([{"preferred_temporality": DELTA}], id="delta"),
        pytest.param([{}, {"preferred_temporality": DELTA}], id="two-readers"),
    ],
)
def test_ten_thousand_short_lived_pids_then_a_newcomer_gets_its_own_series(readers):
    """DataLoader-style churn: 10,000 worker PIDs, each alive for one collection, beside a
    trainer that lives throughout. Every collection exports exactly the live processes, never
    an overflow point; the trainer's cumulative series keeps its start time; and a process
    that starts after the churn is reported under its own PID in every process metric."""
    sdk_readers = [InMemoryMetricReader(**kwargs) for kwargs in readers]
    provider = MeterProvider(metric_readers=sdk_readers)
    current = [snapshot(0.0, [TRAINER])]
    metrics.register(provider.get_meter("t"), lambda: current[0])
    first_start: dict[int, int] = {}
    next_pid = 10_000
    for epoch in range(EPOCHS):
        workers = list(range(next_pid, next_pid + WORKERS_PER_EPOCH))
        next_pid += WORKERS_PER_EPOCH
        current[0] = snapshot(float(epoch), [TRAINER, *workers])
        for i, reader in enumerate(sdk_readers):
            got = points(reader)
            for name in PROCESS_METRICS:
                pids = sorted(_pids(got[name]))
                assert pids == [TRAINER, *workers], (epoch, name)
            for series in got.values():
                assert not any("otel.metric.overflow" in p.attributes for p in series), epoch
            (trainer,) = [
                p for p in got["process.memory.usage"] if p.attributes["process.pid"] == TRAINER
            ]
            first_start.setdefault(i, trainer.start_time_unix_nano)
            if readers[i] == {}:  # cumulative: a live series keeps its start time
                assert trainer.start_time_unix_nano == first_start[i]
    assert next_pid - 10_000 == 10_000

    current[0] = snapshot(float(EPOCHS), [TRAINER, NEWCOMER])
    for collection in range(3):  # the newcomer stays: it is reported at every collection
        for reader in sdk_readers:
            got = points(reader)
            for name in PROCESS_METRICS:
                pids = sorted(_pids(got[name]))
                assert pids == [TRAINER, NEWCOMER], name
            rss = {p.attributes["process.pid"]: p.value for p in got["process.memory.usage"]}
            if collection == 0:  # (a delta reader reports 0 change afterwards)
                assert rss[NEWCOMER] == NEWCOMER
            for series in got.values():
                assert not any("otel.metric.overflow" in p.attributes for p in series)


def _pids(series: list) -> list[int]:
    """The PIDs of a process metric's points, one per process (process.cpu.utilization has
    a user and a system point each)."""
    return [p.attributes["process.pid"] for p in series if p.attributes.get("cpu.mode") != "system"]


def test_a_reused_pid_starts_a_new_series_after_the_old_process_exited():
    """A worker exits and a later worker gets the same PID (and the same attributes): its
    cumulative series starts anew instead of continuing the old process's."""
    reader = InMemoryMetricReader()
    current = [snapshot(0.0, [TRAINER, 4242])]
    metrics.register(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: current[0])

    def thread_counts() -> dict[int, Any]:
        return {p.attributes["process.pid"]: p for p in points(reader)["process.thread.count"]}

    before = thread_counts()
    current[0] = snapshot(1.0, [TRAINER])
    assert list(thread_counts()) == [TRAINER]  # gone: not exported
    current[0] = snapshot(2.0, [TRAINER, 4242])
    after = thread_counts()
    assert after[4242].start_time_unix_nano > before[4242].start_time_unix_nano
    assert after[TRAINER].start_time_unix_nano == before[TRAINER].start_time_unix_nano


def test_a_view_that_keeps_some_attributes_still_forgets_exited_processes():
    """A user's View that keeps only process.pid: the SDK keys series by the kept attributes,
    and ended ones are still found and forgotten (2,500 PIDs against the 2,000 limit)."""
    reader = InMemoryMetricReader()
    view = View(instrument_name="process.*", attribute_keys={"process.pid", "hw.id"})
    provider = MeterProvider(metric_readers=[reader], views=[view])
    current = [snapshot(0.0, [TRAINER])]
    metrics.register(provider.get_meter("t"), lambda: current[0])
    starts = set()
    for epoch in range(50):
        workers = list(range(10_000 + 50 * epoch, 10_050 + 50 * epoch))
        current[0] = snapshot(float(epoch), [TRAINER, *workers])
        got = points(reader)
        pids = sorted(p.attributes.get("process.pid") for p in got["process.thread.count"])
        assert pids == [TRAINER, *workers], epoch
        assert set(got["process.thread.count"][0].attributes) == {"process.pid"}
        trainer = [p for p in got["process.thread.count"] if p.attributes["process.pid"] == TRAINER]
        starts.add(trainer[0].start_time_unix_nano)
    assert len(starts) == 1  # the live series was never dropped
