"""The helper-to-agent frame stream (otel_gpu/sampling/wire.py): exact round trips across
sweeps, static fields sent once, unchanged records reused, malformed frames refused."""

from __future__ import annotations

import marshal
import pickle

import pytest

from otel_gpu.sampling.snapshot import GpuProcessSample, GpuSample, ProcessSample, Snapshot
from otel_gpu.sampling.wire import FRAME_HEADER, FrameReader, FrameWriter

pytestmark = pytest.mark.unit


def gpu(i: int, used: int = 1 << 30, xids: tuple[int, ...] = ()) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{i}", index=i, name="NVIDIA H100", memory_used=used, memory_total=80 << 30,
        util_gpu=0.5, power_w=300.0, temperature_c=61.0, xid_codes=xids, processes_listed=True,
    )  # fmt: skip


def proc(
    pid: int, cpu: float = 0.0, ppid: int = 1, command: str = "python train.py"
) -> ProcessSample:
    return ProcessSample(
        pid, None, ppid, "python3", command, "alice", 1.7e9, cpu, 10 << 20, 100 << 20, 4, 9,
        True, 1000 + pid,
    )  # fmt: skip


def snapshot(
    procs: list[ProcessSample], gpus: list[GpuSample] | None = None, t: float = 1.0
) -> Snapshot:
    gpus = gpus if gpus is not None else [gpu(0), gpu(1)]
    return Snapshot(
        time=t,
        gpus=tuple(gpus),
        gpu_processes=tuple(
            GpuProcessSample(p.pid, f"GPU-{p.pid % 2}", 1 << 28, 0.25, None) for p in procs
        ),
        processes=tuple(procs),
        processes_dropped=1,
        unmapped_gpu_pids=(77,),
        host_to_local={p.pid: p.pid for p in procs},
        sweep_seconds=0.004,
        nvml_errors=(("TIMEOUT", 2),),
    )


def roundtrip(writer: FrameWriter, reader: FrameReader, snap: Snapshot) -> tuple[Snapshot, int]:
    frame = writer.frame(("snapshot", snap))
    (message,) = reader.feed(frame)
    assert isinstance(message, tuple) and message[0] == "snapshot"
    return message[1], len(frame)


def test_snapshots_round_trip_exactly_across_changing_sweeps() -> None:
    writer, reader = FrameWriter(), FrameReader()
    sweeps = [
        snapshot([proc(10), proc(11), proc(12)]),
        snapshot([proc(10), proc(11, cpu=0.5), proc(12)], t=2.0),  # one value changed
        snapshot([proc(10), proc(12, ppid=10)], t=3.0),  # 11 exited, 12 re-parented
        snapshot([proc(10), proc(12, ppid=10), proc(13, command="python eval.py")], t=4.0),
        snapshot([proc(11), proc(10)], [gpu(0, used=2 << 30, xids=(79,))], t=5.0),  # 11 again
        Snapshot(time=6.0, no_gpu_reason="NVML reports no GPU"),
    ]
    for snap in sweeps:
        got, _size = roundtrip(writer, reader, snap)
        assert got == snap


def test_static_fields_are_sent_once_and_unchanged_records_are_reused() -> None:
    writer, reader = FrameWriter(), FrameReader()
    procs = [
        proc(pid, command="python -m torch.distributed.run --nproc 8 train.py")
        for pid in range(100, 164)
    ]
    first, first_size = roundtrip(writer, reader, snapshot(procs))
    again, again_size = roundtrip(writer, reader, snapshot(procs, t=2.0))
    # A pickle of the same sweep is as large as the first frame every time.
    assert len(pickle.dumps(snapshot(procs, t=2.0))) > 5 * again_size
    assert again_size * 5 < first_size
    assert all(a is b for a, b in zip(first.processes, again.processes, strict=True))
    changed = [*procs[:5], procs[5]._replace(cpu_utilization=0.75), *procs[6:]]
    third, _ = roundtrip(writer, reader, snapshot(changed, t=3.0))
    assert third.processes[5].cpu_utilization == 0.75
    assert third.processes[5] is not again.processes[5]
    assert third.processes[4] is again.processes[4]


def test_a_new_reader_needs_the_definitions_a_new_writer_sends() -> None:
    """A new helper process (new writer) and the agent's new reader start with empty tables."""
    old_writer = FrameWriter()
    old_writer.frame(("snapshot", snapshot([proc(10)])))
    unchanged = old_writer.frame(("snapshot", snapshot([proc(10)], t=2.0)))
    with pytest.raises(ValueError, match="malformed snapshot"):
        FrameReader().feed(unchanged)  # refers to entries this reader never saw
    got, _ = roundtrip(FrameWriter(), FrameReader(), snapshot([proc(10)]))
    assert got.processes == (proc(10),)


def test_other_messages_pass_and_frames_may_arrive_in_pieces() -> None:
    writer, reader = FrameWriter(), FrameReader()
    data = writer.frame(("hung", {"pid": 42})) + writer.frame(("snapshot", snapshot([proc(1)])))
    messages: list[object] = []
    for i in range(0, len(data), 7):
        messages += reader.feed(data[i : i + 7])
    assert messages[0] == ("hung", {"pid": 42})
    assert isinstance(messages[1], tuple) and messages[1][1] == snapshot([proc(1)])


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00garbage",  # not marshal data
        marshal.dumps(("snapshot", ("snapshot/0", 1.0))),  # another encoding version
        marshal.dumps(("snapshot", ("snapshot/1", 1.0, (), ()))),  # fields missing
        marshal.dumps(("snapshot", ("snapshot/1", 1.0, (5,), (), (), 0, (), None, None, None, ()))),
    ],
)
def test_malformed_frames_are_a_broken_stream(payload: bytes) -> None:
    with pytest.raises(ValueError):
        FrameReader().feed(FRAME_HEADER.pack(len(payload)) + payload)


def test_an_oversized_frame_header_is_refused_before_reading_it() -> None:
    with pytest.raises(ValueError, match="corrupt sampler stream"):
        FrameReader().feed(FRAME_HEADER.pack(1 << 30))
