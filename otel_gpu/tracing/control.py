"""Graceful checkpoint-and-stop, requested from any thread, carried out by the trainer callback.

:func:`request_stop` only sets a flag. The trainer's callback checks it at the end of each
optimizer step; under DDP all ranks first agree through one all-reduce (MAX) of one integer
every ``OTEL_GPU_STOP_SYNC_STEPS`` steps, because a stop taken by one rank alone deadlocks the
others in the next collective or in the checkpoint barrier (docs/background.md §5). Then every rank
saves the checkpoint and leaves the training loop at that same step.

No signal handler is installed, so this coexists with ms-swift's ``graceful_exit`` callback and
transformers' ``enable_jit_checkpoint``. Off unless ``OTEL_GPU_STOP=true``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("otel_gpu.stop")

_lock = threading.Lock()
_reason: str | None = None
_takers = 0  # trainers in this process that are training with stop enabled


@dataclass(frozen=True)
class StopDecision:
    """What the ranks agreed on at one step."""

    reason: str  # the local reason, or a note naming the requesting rank
    requested_by: int  # global rank that asked (the highest one if several did)


def request_stop(reason: str) -> bool:
    """Ask the in-process trainer to save a checkpoint and stop at the end of the current step.

    Callable from any thread; returns at once. True when a trainer in this process is
    training with the stop mechanism enabled and will act on it; False otherwise (nothing is
    remembered then, so a later trainer does not stop for an old reason).
    """
    global _reason
    with _lock:
        if _takers <= 0:
            return False
        if _reason is None:
            _reason = reason or "stop requested"
    log.warning("otel-gpu: checkpoint-and-stop requested: %s", reason)
    return True


def attach() -> None:
    """A trainer with stop enabled started training here."""
    global _takers
    with _lock:
        _takers += 1


def detach() -> None:
    """That trainer finished; forget any request it did not act on."""
    global _takers, _reason
    with _lock:
        _takers = max(0, _takers - 1)
        if _takers == 0:
            _reason = None


def consume() -> None:
    """The request was acted on."""
    global _reason
    with _lock:
        _reason = None


def decide(
    step: int,
    sync_steps: int,
    rank: int,
    all_reduce_max: Callable[[int], int] | None,
) -> StopDecision | None:
    """Whether to stop at the end of ``step``; the same answer on every rank.

    ``all_reduce_max`` is None in a single process; with DDP it takes this rank's vote
    (requesting rank + 1, or 0) and returns the maximum over all ranks. It is called on exactly
    the steps where ``step % sync_steps == 0``, on every rank, so the collective always matches.
    """
    local = _reason
    if all_reduce_max is None:
        return StopDecision(local, rank) if local is not None else None
    if step % sync_steps != 0:
        return None
    agreed = all_reduce_max(rank + 1 if local is not None else 0)
    if agreed <= 0:
        return None
    requester = agreed - 1
    if local is not None and requester == rank:
        return StopDecision(local, rank)
    return StopDecision(local or f"stop requested on rank {requester}", requester)


def torch_all_reduce_max() -> Callable[[int], int] | None:
    """An all-reduce over the default process group, or None outside a multi-rank job."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None

    def reduce(vote: int) -> int:
        device = "cpu"
        if dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        tensor = torch.tensor([vote], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    return reduce
