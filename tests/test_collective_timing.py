"""The collective timing of the in-process part (issue 22 §2): only the time a rank blocks in a
collective is counted, once; the original's errors reach the job unchanged; a failure of the
wrapper's own check calls the original untimed; ``OTEL_GPU_COLLECTIVE_TIMING=false`` leaves
``torch.distributed`` untouched; a step's time splits into wait and work. A stand-in
``torch.distributed`` whose collectives sleep (the real gloo job is in
tests/test_straggler_job.py, the cost in benchmarks/bench_collective_timing.py)."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator

import pytest

from otel_gpu.tracing import collective_timing as timing
from otel_gpu.tracing import progress
from otel_gpu.tracing.settings import TracingSettings

pytestmark = pytest.mark.unit

BLOCK_S = 0.05
WAIT_S = 0.03


class Work:
    """A collective's handle: ``wait()`` blocks until the peers are done."""

    def wait(self, timeout: float | None = None) -> bool:
        time.sleep(WAIT_S)
        return True


class Mismatch(RuntimeError):
    pass


def _fake_dist() -> types.ModuleType:
    dist = types.ModuleType("fake_dist")

    def all_reduce(tensor, op=None, group=None, async_op=False):  # noqa: ANN001, ANN202
        if async_op is True:
            return Work()
        time.sleep(BLOCK_S)
        return None

    def broadcast(tensor, src=0, group=None, async_op=False):  # noqa: ANN001, ANN202
        work = Work()
        return work if async_op else work.wait()  # a blocking call waits on its own work

    def barrier(group=None, async_op=False, device_ids=None):  # noqa: ANN001, ANN202
        raise Mismatch("rank 1 called broadcast")

    dist.all_reduce, dist.broadcast, dist.barrier = all_reduce, broadcast, barrier  # type: ignore[attr-defined]
    dist.Work = Work  # type: ignore[attr-defined]
    dist.is_available = lambda: True  # type: ignore[attr-defined]
    return dist


@pytest.fixture
def dist() -> Iterator[types.ModuleType]:
    before = timing._module  # another test's install (the real torch.distributed) comes back
    timing.uninstall()
    timing._reset_after_fork()
    progress._reset_after_fork()
    fake = _fake_dist()
    assert timing.install(fake)
    yield fake
    timing.uninstall()
    timing._reset_after_fork()
    progress._reset_after_fork()
    if before is not None:
        timing.install(before)


def test_only_blocking_time_is_counted_and_a_waited_work_once(dist) -> None:
    dist.all_reduce([1.0])
    calls, waited = timing.totals()
    assert calls == 1 and BLOCK_S <= waited < BLOCK_S + 0.04
    # async: returns at once, not timed; the wait on its work is (the rank blocks there)
    work = dist.all_reduce([1.0], async_op=True)
    assert timing.totals() == (1, waited)
    work2 = dist.all_reduce([1.0], None, None, True)  # async_op given positionally
    assert timing.totals() == (1, waited)
    assert work.wait() is True and work2.wait(5.0) is True
    calls, total = timing.totals()
    assert calls == 3 and 2 * WAIT_S <= total - waited < 2 * WAIT_S + 0.04
    # a blocking collective that waits on its own work: one call, its time once
    dist.broadcast([1.0])
    calls, after = timing.totals()
    assert calls == 4 and WAIT_S <= after - total < WAIT_S + 0.03


def test_the_originals_error_reaches_the_caller_unchanged(dist) -> None:
    with pytest.raises(Mismatch, match="rank 1 called broadcast") as caught:
        dist.barrier()
    assert caught.type is Mismatch and caught.value.__traceback__ is not None
    assert timing.totals()[0] == 1  # the time up to the error is the rank's too
    dist.all_reduce([1.0])  # and timing goes on after it
    assert timing.totals()[0] == 2


def test_a_failing_check_calls_the_original_untimed(dist) -> None:
    class Ambiguous:  # like a tensor of several values: no truth value
        def __bool__(self) -> bool:
            raise RuntimeError("ambiguous")

    assert dist.all_reduce([1.0], None, None, Ambiguous()) is None  # ran, blocking
    assert timing.totals() == (0, 0.0)


def test_wrappers_keep_the_functions_names_and_uninstall_gives_them_back() -> None:
    fake = _fake_dist()
    originals = (fake.all_reduce, fake.broadcast, fake.barrier, Work.wait)
    before = timing._module
    timing.uninstall()
    try:
        assert timing.install(fake) and fake.all_reduce is not originals[0]
        assert fake.all_reduce.__name__ == "all_reduce"
        assert fake.all_reduce.__wrapped__ is originals[0]
        assert timing.install(fake)  # once: nothing wrapped twice
        assert fake.all_reduce.__wrapped__ is originals[0]
        timing.uninstall()
        assert (fake.all_reduce, fake.broadcast, fake.barrier, Work.wait) == originals
    finally:
        timing.uninstall()
        if before is not None:
            timing.install(before)


def test_opting_out_leaves_torch_distributed_untouched() -> None:
    assert TracingSettings().collective_timing is True
    assert TracingSettings.load({"OTEL_GPU_COLLECTIVE_TIMING": "false"}).collective_timing is False
    import torch.distributed

    before = timing._module
    timing.uninstall()
    try:
        own = torch.distributed.all_reduce, torch.distributed.Work.wait
        assert timing.hook(False) is False
        assert (torch.distributed.all_reduce, torch.distributed.Work.wait) == own
        assert not timing.installed()
        assert timing.hook(True) and timing.installed()  # torch is imported: installed now
        assert torch.distributed.all_reduce.__wrapped__ is own[0]
    finally:
        timing.uninstall()
        if before is not None:
            timing.install(before)
    assert torch.distributed.all_reduce is own[0] and torch.distributed.Work.wait == own[1]


def test_a_step_splits_into_collective_wait_and_work(dist) -> None:
    progress.set_step(1)
    time.sleep(0.02)
    progress.set_step(2)
    assert "work_s" not in progress.numbers()  # no collective timed yet: no split reported
    time.sleep(0.1)  # computing
    dist.all_reduce([1.0])  # waiting for the others
    progress.set_step(3)
    numbers = progress.numbers()
    assert BLOCK_S <= numbers["collective_wait_s"] < BLOCK_S + 0.04
    assert 0.1 <= numbers["work_s"] < 0.15
    assert numbers["work_s"] + numbers["collective_wait_s"] == pytest.approx(numbers["step_s"])
    # two steps ended at once (gradient accumulation, a late report): the mean of each
    dist.all_reduce([1.0])
    dist.all_reduce([1.0])
    progress.set_step(5)
    assert BLOCK_S <= progress.numbers()["collective_wait_s"] < BLOCK_S + 0.04
