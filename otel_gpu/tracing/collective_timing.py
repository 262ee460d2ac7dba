"""How long this rank waits in ``torch.distributed`` collectives, timed on the CPU.

In data parallel every rank's step takes as long as the slowest rank's: the fast ranks spend
the difference waiting in their collectives. A step's time less that wait is the rank's *work*
(:mod:`otel_gpu.tracing.progress` exports both per step; the processor's straggler judge,
:mod:`otel_gpu.detect.straggler`, compares the ranks' work).

:func:`install` wraps the collectives of ``torch.distributed`` (:data:`COLLECTIVES`: all-reduce,
all-gather, broadcast, barrier, reduce-scatter, all-to-all, their ``*_into_tensor`` / ``_base``
/ ``*_object`` forms, send and recv) and ``Work.wait``:

- a call with ``async_op=False`` (the default) is timed from call to return;
- an ``async_op=True`` call returns at once and is not timed; the ``wait()`` on the work it
  returned is, when Python calls it (``work.wait()``); a wait inside a timed call (a blocking
  collective waits on its own work) is not counted twice. Waits C++ does itself are not seen:
  DDP's gradient all-reduce (its buckets are waited for inside ``backward()``), a future's
  ``wait()`` (``work.get_future()``), functional collectives (``wait_tensor``).

What the CPU sees is the wait only where the CPU waits: with gloo (and MPI) a blocking call
returns once the data is there, so the time is exact. With NCCL a call, and ``wait()``, only
enqueue work on a CUDA stream and return: the rank's waiting happens on the GPU, later, where
this timing does not look (nor does it read the flight recorder's durations, which
``TORCH_NCCL_ENABLE_TIMING=1`` adds), so on NCCL every rank's work reads as its whole step and
no straggler is named.

Cost per timed call: a ``perf_counter`` pair, a few thread-local reads and writes, the
``torch.compile`` check and a float add, no allocation but the floats: about 0.5-0.7 us on the
development VM, beside 9-56 us for a one-rank gloo all-reduce of 4 floats
(``benchmarks/bench_collective_timing.py``). Inside a ``torch.compile`` region the original is
called as is (Dynamo then sees the collective it knows). A failure of the wrapper's own code
calls the original untimed; the original's errors reach the caller unchanged.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("otel_gpu.tracing")

# The functions of torch.distributed that wait for other ranks (those a torch version lacks
# are skipped).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "send_object_list",
    "recv_object_list",
)
_MARK = "__otel_gpu_timed__"


class _Inside(threading.local):
    depth = 0  # 1 while this thread is inside a timed call


_inside = _Inside()
_lock = threading.Lock()
_calls = 0  # timed calls in this process
_wait_s = 0.0  # seconds spent in them
_module: Any = None  # the torch.distributed we wrapped
_originals: dict[str, Any] = {}
_work: tuple[Any, Any] | None = None  # (Work class, its original wait)


def totals() -> tuple[int, float]:
    """(timed calls, seconds they took) in this process so far."""
    return _calls, _wait_s


def installed() -> bool:
    return _module is not None


def _reset_after_fork() -> None:
    # A forked child (a DataLoader worker) starts from nothing: its parent's waits are not its.
    global _calls, _wait_s
    _calls, _wait_s = 0, 0.0
    _inside.depth = 0


os.register_at_fork(after_in_child=_reset_after_fork)


def _compiling() -> Callable[[], bool]:
    try:
        import torch.compiler

        return torch.compiler.is_compiling  # type: ignore[no-any-return]
    except Exception:
        return lambda: False


def _async_index(function: Callable[..., Any]) -> int | None:
    """Where ``async_op`` sits among the positional arguments, None when it cannot be given
    positionally (or the function has none)."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "async_op":
            return i if p.kind is p.POSITIONAL_OR_KEYWORD else None
    return None


def timed(original: Callable[..., Any], async_at: int | None, compiling: Callable[[], bool]) -> Any:
    """``original`` timed when it blocks (``async_op`` false or absent, ``async_op`` at
    positional index ``async_at`` when given there)."""
    perf = time.perf_counter
    inside = _inside

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        global _calls, _wait_s
        try:
            skip = bool(
                compiling()  # first: under Dynamo nothing else here is traced
                or inside.depth
                or kwargs.get("async_op")
                or (async_at is not None and len(args) > async_at and args[async_at])
            )
        except Exception:  # our check failed (an odd argument): the call goes on, untimed
            skip = True
        if skip:
            return original(*args, **kwargs)
        inside.depth = 1
        start = perf()
        try:
            return original(*args, **kwargs)
        finally:
            _wait_s += perf() - start
            _calls += 1
            inside.depth = 0

    setattr(collective, _MARK, True)
    return collective


def _timed_wait(original: Callable[..., Any], compiling: Callable[[], bool]) -> Any:
    """``Work.wait`` timed, unless a timed collective is waiting on its own work."""
    perf = time.perf_counter
    inside = _inside

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _calls, _wait_s
        try:
            skip = bool(inside.depth or compiling())  # inside: a blocking call's own wait
        except Exception:
            skip = True
        if skip:
            return original(self, *args, **kwargs)
        inside.depth = 1
        start = perf()
        try:
            return original(self, *args, **kwargs)
        finally:
            _wait_s += perf() - start
            _calls += 1
            inside.depth = 0

    wait.__doc__ = getattr(original, "__doc__", None)
    setattr(wait, _MARK, True)
    return wait


def install(dist: Any = None) -> bool:
    """Time the collectives of ``dist`` (default: ``torch.distributed``), once per process;
    True when they are timed. Never raises: what cannot be wrapped is left as it is."""
    global _module, _work
    with _lock:
        if _module is not None:
            return True
        try:
            if dist is None:
                import torch.distributed as dist
            available = getattr(dist, "is_available", None)
            if available is not None and not available():
                return False
            compiling = _compiling()
            for name in COLLECTIVES:
                function = getattr(dist, name, None)
                if not callable(function) or getattr(function, _MARK, False):
                    continue
                setattr(dist, name, timed(function, _async_index(function), compiling))
                _originals[name] = function
            work = getattr(dist, "Work", None)
            wait = getattr(work, "wait", None)
            if work is not None and callable(wait) and not getattr(wait, _MARK, False):
                try:
                    work.wait = _timed_wait(wait, compiling)
                    _work = (work, wait)
                except (AttributeError, TypeError):  # a class that takes no new attribute
                    log.debug("otel-gpu: Work.wait not timed: async collectives not counted")
            _module = dist
        except Exception as exc:  # never harm the job: it runs on, untimed
            log.warning("otel-gpu: collective timing not installed: %s", exc)
            _restore(dist)
            return False
    return True


def uninstall() -> None:
    """Give ``torch.distributed`` its own functions back (those nobody wrapped over since)."""
    global _module
    with _lock:
        if _module is not None:
            _restore(_module)
        _module = None


def _restore(dist: Any) -> None:
    global _work
    for name, function in _originals.items():
        if getattr(getattr(dist, name, None), _MARK, False):
            setattr(dist, name, function)
    _originals.clear()
    if _work is not None:
        work, wait = _work
        if getattr(getattr(work, "wait", None), _MARK, False):
            work.wait = wait
        _work = None


def hook(enabled: bool) -> bool:
    """Install the timing when ``torch.distributed`` is imported (now, if it is already), unless
    ``enabled`` is false (``OTEL_GPU_COLLECTIVE_TIMING=false``): then torch is left untouched.
    True when the hook was registered."""
    if not enabled:
        return False
    import wrapt

    wrapt.register_post_import_hook(install, "torch.distributed")
    return True
