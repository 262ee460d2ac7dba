"""GPU allocation sites and the OOM post-mortem as pure functions on snapshot dicts in the
format torch.cuda.memory._snapshot() documents, and the guards that make them do nothing on a
CPU build (issue 20 §2). The real CUDA run needs a GPU (none lent to this suite)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from otel_gpu.agent.memory_diagnosis import diagnosis_from
from otel_gpu.diagnose import cuda_memory as cm
from otel_gpu.diagnose.memory_settings import MemorySettings
from otel_gpu.tracing import memory_ops

pytestmark = pytest.mark.unit

TORCH_FRAME = {
    "filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py",
    "line": 125,
    "name": "forward",
}
USER_FRAME = {"filename": "/home/me/train.py", "line": 41, "name": "train"}
CACHE_FRAME = {"filename": "/home/me/model.py", "line": 12, "name": "forward"}


def block(
    size: int, frames: list[dict[str, Any]], state: str = "active_allocated"
) -> dict[str, Any]:
    return {"size": size, "requested_size": size, "state": state, "frames": frames}


def snap(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {
        "segments": [{"device": 0, "total_size": 1 << 30, "blocks": list(blocks)}],
        "device_traces": [],
    }


def test_the_site_is_the_first_frame_of_the_programs_own_code() -> None:
    assert cm.site_of([TORCH_FRAME, CACHE_FRAME, USER_FRAME]) == "model.py:12 in forward"
    assert cm.site_of([TORCH_FRAME]) == cm.UNATTRIBUTED
    assert cm.site_of([]) == cm.UNATTRIBUTED


def test_sites_rank_by_growth_of_live_bytes_and_frameless_blocks_are_one_row() -> None:
    before = snap(block(1 << 20, [TORCH_FRAME, USER_FRAME]), block(4 << 20, []))
    after = snap(
        block(1 << 20, [TORCH_FRAME, USER_FRAME]),
        *(block(2 << 20, [TORCH_FRAME, CACHE_FRAME]) for _ in range(5)),
        block(4 << 20, []),
        block(8 << 20, []),
        block(64 << 20, [CACHE_FRAME], state="inactive"),  # freed: cached, not live
    )
    rows = cm.rank_sites(before, after)
    assert [(r["site"], r["growth_bytes"], r["growth_blocks"]) for r in rows] == [
        ("model.py:12 in forward", 10 << 20, 5),
        (cm.UNATTRIBUTED, 8 << 20, 1),
        ("train.py:41 in train", 0, 0),
    ]


def _settle_viewer_threads() -> None:
    for t in threading.enumerate():
        if t.name == "otel-gpu-oom-snapshot":
            t.join(10)


def test_the_oom_observer_writes_one_post_mortem_per_oom_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []
    now = [0.0]

    def take() -> dict[str, Any]:
        calls.append(1)
        return snap(block(3 << 20, [CACHE_FRAME]), block(1 << 20, []))

    observe = cm.oom_observer(str(tmp_path), take, 4242, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="otel_gpu.actions"):
        observe(0, 1 << 30, 70 << 30, 1 << 20)
        now[0] = 1.0
        observe(0, 1 << 30, 70 << 30, 1 << 20)  # the allocator retrying the same OOM
    _settle_viewer_threads()
    path = tmp_path / "oom-4242-1.json"
    report = json.loads(path.read_text())
    assert calls == [1] and oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert report["requested_bytes"] == 1 << 30 and report["device_free_bytes"] == 1 << 20
    assert report["sites"][0] == {"site": "model.py:12 in forward", "blocks": 1, "bytes": 3 << 20}
    # The snapshot itself, for PyTorch's memory viewer (it loads a pickled snapshot dict).
    viewer = tmp_path / "oom-4242-1.pickle"
    assert pickle.loads(viewer.read_bytes())["segments"][0]["blocks"][0]["size"] == 3 << 20
    assert oct(os.stat(viewer).st_mode & 0o777) == "0o600"
    [alert] = [r.getMessage() for r in caplog.records]
    assert alert == (
        "otel-gpu ALERT: oom (warning) on pid 4242: CUDA out of memory on device 0 asking "
        "1.0 GiB (1.0 MiB free), raised to the job (it may catch it); largest holders: none "
        "found; largest live allocation sites: model.py:12 in forward (3.0 MiB), (unattributed) "
        f"(1.0 MiB); post-mortem {path}"
    )
    # A job that catches its OOMs (a batch-size search): each new one is reported, up to three.
    for i in range(5):
        now[0] = 10.0 + 10 * i
        observe(0, (2 + i) << 30, 70 << 30, 1 << 20)
    _settle_viewer_threads()
    assert sorted(p.name for p in tmp_path.glob("oom-4242-*.json")) == [
        f"oom-4242-{n}.json" for n in (1, 2, 3)
    ]
    assert len(calls) == cm.MAX_OOM_REPORTS
    broken = cm.oom_observer(str(tmp_path / "missing"), lambda: 1 / 0, 1)  # type: ignore[arg-type,return-value]
    broken(0, 1, 2, 3)  # must not raise into the allocator's error path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-build guards")
def test_on_a_cpu_build_every_cuda_call_does_nothing_and_says_so(tmp_path: Path) -> None:
    assert cm.history_on(torch) is False and cm.history_off(torch) is False
    assert cm.snapshot(torch) is None
    assert cm.attach_oom_observer(torch, str(tmp_path)) is False
    assert list(tmp_path.iterdir()) == []


class Allocator:
    """The three allocator calls a :class:`cm.SiteWatch` makes, answered with snapshot dicts in
    the documented format: what a planted leak at model.py:12 looks like as it grows."""

    def __init__(self) -> None:
        self.history = False
        self.calls: list[str] = []
        self.leaked = 0
        self.fail_take = False

    def on(self) -> bool:
        self.calls.append("on")
        self.history = True
        return True

    def off(self) -> bool:
        self.calls.append("off")
        self.history = False
        return True

    def take(self) -> dict[str, Any]:
        self.calls.append("take")
        if self.fail_take:
            raise MemoryError("no room for the snapshot")
        frames = [TORCH_FRAME, CACHE_FRAME] if self.history else []
        return snap(block(4 << 20, []), *(block(1 << 20, frames) for _ in range(self.leaked)))


class Timers:
    """The watch's timer, fired by hand."""

    def __init__(self) -> None:
        self.pending: list[list[Any]] = []

    def __call__(self, seconds: float, fn: Any) -> Any:
        entry = [seconds, fn, False]
        self.pending.append(entry)

        class Handle:
            def cancel(self) -> None:
                entry[2] = True

        return Handle()

    def fire(self) -> None:
        for entry in self.pending:
            if not entry[2]:
                entry[1]()


def test_a_suspicion_ranks_the_growth_since_it_began_and_switches_the_history_off() -> None:
    alloc, timers = Allocator(), Timers()
    watch = cm.SiteWatch(alloc.on, alloc.off, alloc.take, max_on_s=600, timer=timers)
    assert watch.confirm() is None and alloc.calls == []  # no suspicion: nothing asked
    assert watch.suspect() and watch.suspect() and watch.active
    assert alloc.calls == ["on", "take"]  # once: a second suspicion keeps the first baseline
    assert [e[0] for e in timers.pending] == [600]
    alloc.leaked = 3
    rows = watch.confirm()
    assert rows is not None and not watch.active and alloc.calls[-2:] == ["take", "off"]
    assert [(r["site"], r["growth_bytes"], r["growth_blocks"]) for r in rows][:1] == [
        ("model.py:12 in forward", 3 << 20, 3)
    ]
    assert timers.pending[0][2]  # the expiry was cancelled
    assert cm.site_lines(rows, 30) == [
        "GPU memory allocated at model.py:12 in forward: +3.0 MiB in +3 blocks in 30 s "
        "(now 3.0 MiB live)"
    ]
    # A suspicion never confirmed: its timer switches the history off, with no census asked.
    watch.suspect()
    timers.fire()
    assert not watch.active and alloc.calls[-1] == "off" and not alloc.history
    # A snapshot that fails right after the history went on leaves it off, not on and untracked.
    alloc.fail_take = True
    with pytest.raises(MemoryError):
        watch.suspect()
    assert not alloc.history and not watch.active
    # Where the history cannot be switched on (a CPU build, a job recording its own), nothing.
    refused = cm.SiteWatch(lambda: False, alloc.off, alloc.take, max_on_s=600, timer=timers)
    assert not refused.suspect() and refused.confirm() is None
    assert refused.interval_start() is None


def test_an_interval_ranks_its_own_growth_and_leaves_a_suspicions_history_alone() -> None:
    alloc, timers = Allocator(), Timers()
    watch = cm.SiteWatch(alloc.on, alloc.off, alloc.take, max_on_s=600, timer=timers)
    start = watch.interval_start()  # no suspicion: the interval switches the history on
    assert start is not None and alloc.history
    alloc.leaked = 2
    rows = watch.interval_end(start)
    assert rows[0]["growth_bytes"] == 2 << 20 and not alloc.history
    # During a suspicion: its own baseline, the history stays on, the suspicion's kept.
    alloc.leaked = 0
    watch.suspect()
    alloc.leaked = 1
    start = watch.interval_start()
    alloc.leaked = 4
    rows = watch.interval_end(start)
    assert rows[0]["growth_bytes"] == 3 << 20 and alloc.history and watch.active
    confirmed = watch.confirm() or []
    assert confirmed[0]["growth_bytes"] == 4 << 20 and not alloc.history


def test_the_census_reply_carries_the_sites_from_a_suspicion_to_its_confirmation() -> None:
    alloc, timers = Allocator(), Timers()
    watch = cm.SiteWatch(alloc.on, alloc.off, alloc.take, max_on_s=600, timer=timers)
    handle = memory_ops.census_handler(MemorySettings(census_max_s=0.5), sites=lambda: watch)
    plain = handle({"over_s": 0, "top": 1})  # a one-off census switches nothing on
    assert "sites" not in plain and "sites_recording" not in plain and alloc.calls == []
    baseline = handle({"over_s": 0, "top": 1, "sites": "suspect"})  # the agent's, on suspicion
    assert baseline["sites_recording"] is True and "sites" not in baseline
    assert alloc.history  # on until the confirmation asks
    alloc.leaked = 5
    confirm = handle({"over_s": 0, "baseline": "last", "top": 5, "sites": "confirm"})
    assert not alloc.history and "sites_recording" not in confirm
    assert confirm["sites"][0]["site"] == "model.py:12 in forward"
    assert confirm["site_lines"][0] == (
        "GPU memory allocated at model.py:12 in forward: +5.0 MiB in +5 blocks since the leak "
        "was suspected (now 5.0 MiB live)"
    )
    # diagnose memory --over: the interval's growth, the history off again after it.
    alloc.leaked = 0
    timed = handle({"over_s": 0.2, "samples": 2, "top": 5})
    assert timed["sites"][0]["growth_bytes"] == 0 and not alloc.history
    assert timed["site_lines"] == []
    # The alert's diagnosis: the holders first, the top site within the three lines shown.
    found = diagnosis_from(42, {**confirm, "lines": ["a.b: +1 tensors"]}, 0.1)
    assert found.lines[:2] == ("a.b: +1 tensors", confirm["site_lines"][0])
    assert [r["site"] for r in found.data["sites"]] == ["model.py:12 in forward"]  # grown only
    # Only a site that grew, and no holder: the site is the diagnosis, not "nothing grew".
    alone = diagnosis_from(42, {**confirm, "lines": []}, 0.1)
    assert alone.error is None and alone.lines == tuple(confirm["site_lines"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-build wiring")
def test_on_a_cpu_build_the_census_has_no_sites_and_the_oom_observer_waits_for_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = memory_ops.census_handler(MemorySettings(census_max_s=0.5))({"sites": "suspect"})
    assert "sites" not in reply and "sites_recording" not in reply
    queued = len(torch.cuda._queued_calls)
    cm.watch_oom(str(tmp_path))  # torch is imported: the hook runs now, CUDA never starts
    assert len(torch.cuda._queued_calls) == queued + 1
    attach = torch.cuda._queued_calls.pop()[0]  # what CUDA's initialisation would run
    attach()  # no CUDA: attaches nothing, raises nothing
    assert list(tmp_path.iterdir()) == []

    # Inside CUDA's initialisation an exception would fail the job's first CUDA call.
    def refuse(*_args: Any) -> bool:
        raise RuntimeError("allocator not ready")

    monkeypatch.setattr(cm, "attach_oom_observer", refuse)
    cm.watch_oom(str(tmp_path))
    torch.cuda._queued_calls.pop()[0]()  # does not raise
    # OTEL_GPU_DIAGNOSE_OOM=false: nothing is queued at all.
    queued = len(torch.cuda._queued_calls)
    assert memory_ops.register({"OTEL_GPU_DIAGNOSE_OOM": "false"})
    assert len(torch.cuda._queued_calls) == queued


def test_diagnose_memory_prints_the_sites_that_grew_below_the_holders() -> None:
    from otel_gpu.commands.diagnose import table

    alloc = Allocator()
    watch = cm.SiteWatch(alloc.on, alloc.off, alloc.take, max_on_s=600, timer=Timers())
    start = watch.interval_start()
    assert start is not None
    alloc.leaked = 2
    rows = watch.interval_end(start)
    reply = {"pid": 7, "over_s": 5.0, "holders": [], "site_lines": cm.site_lines(rows, 5.0)}
    assert table(reply, 10).splitlines()[-1] == (
        "GPU memory allocated at model.py:12 in forward: +2.0 MiB in +2 blocks in 5 s "
        "(now 2.0 MiB live)"
    )
    assert "GPU memory" not in table({**reply, "site_lines": []}, 10)


HELD_BY_THIS_MODULE = [torch.ones(512, 512) for _ in range(4)]  # 4 MiB, for the OOM's census


def test_the_oom_post_mortem_names_the_largest_holders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The census runs on a thread of its own inside the observer, bounded. The bound is
    # raised here: a loaded test worker must not turn "names the holder" into a timing test.
    monkeypatch.setattr(memory_ops, "OOM_CENSUS_S", 60.0)
    holders = memory_ops.oom_holders(MemorySettings(census_max_s=60))
    observe = cm.oom_observer(
        str(tmp_path), lambda: snap(block(3 << 20, [CACHE_FRAME])), 7, holders
    )
    with caplog.at_level(logging.ERROR, logger="otel_gpu.actions"):
        observe(0, 1 << 30, 70 << 30, 1 << 20)
    _settle_viewer_threads()
    report = json.loads((tmp_path / "oom-7-1.json").read_text())
    [mine] = [h for h in report["holders"] if h["path"].endswith("HELD_BY_THIS_MODULE")]
    assert mine["count"] == 4 and mine["bytes"] == 4 * 512 * 512 * 4 and mine["root"] == "global"
    assert "holders_note" not in report
    [alert] = [r.getMessage() for r in caplog.records]
    assert "largest holders: " in alert and "largest holders: none found" not in alert
    # A census that does not end in time: the post-mortem is written without holders, and
    # says why ("none found" would read as "no tensor is held").
    release = threading.Event()
    monkeypatch.setattr(memory_ops.census, "take", lambda _bounds: release.wait(30))
    monkeypatch.setattr(memory_ops, "OOM_CENSUS_S", 0.2)
    started = time.monotonic()
    assert memory_ops.oom_holders(MemorySettings())() == {
        "holders": [],
        "holders_note": "census did not end in 1.2 s",
    }
    assert time.monotonic() - started < 5
    release.set()
    # A census a bound stopped: what it reached is named, and the line says it was cut short.
    monkeypatch.undo()
    cut = memory_ops.oom_holders(MemorySettings(census_max_objects=1))()
    assert cut["holders_note"] == "census cut short (objects: stopped after 1 objects)"
    report = {"device": 0, "requested_bytes": 1 << 30, "device_free_bytes": 0, "sites": []}
    line = cm.oom_alert_line(7, {**report, "holders": [], "holders_note": "census cut short "
                                 "(time: stopped after 2 s)"}, "p.json")  # fmt: skip
    assert "largest holders: none found (census cut short (time: stopped after 2 s));" in line


def test_a_failing_allocator_snapshot_leaves_the_census_answering() -> None:
    alloc = Allocator()
    alloc.fail_take = True
    watch = cm.SiteWatch(alloc.on, alloc.off, alloc.take, max_on_s=600, timer=Timers())
    handle = memory_ops.census_handler(MemorySettings(census_max_s=0.5), sites=lambda: watch)
    reply = handle({"over_s": 0, "top": 1, "sites": "suspect"})
    assert "holders" in reply and "error" not in reply and "sites" not in reply
    assert not alloc.history and not watch.active  # switched off again, nothing kept
