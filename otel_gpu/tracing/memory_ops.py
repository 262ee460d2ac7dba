"""The trainer's memory operations on the control channel (docs/inprocess.md, issue 20 §2-§3).

``memory.census``: live tensors by holder, and their growth over ``over_s`` seconds (``samples``
censuses spread over it), or since the census before (``baseline: "last"``, how the agent's
leak diagnoser compares a suspicion's census with the confirmation's). Runs on the channel's
request thread, one census at a time, bounded by :class:`~otel_gpu.diagnose.memory_settings.
MemorySettings` (read once, here). Never reads a tensor's values.

Where this process has initialised CUDA, the census also looks for the GPU allocation sites
(:class:`otel_gpu.diagnose.cuda_memory.SiteWatch`): the agent's census on a leak suspicion
(``sites: "suspect"``) switches the allocator history on; its census on the alert
(``sites: "confirm"``) ranks the sites grown since (``sites``, ``site_lines`` in the reply)
and switches it off; any census over an interval (``diagnose memory --over``) ranks the
growth over that interval, leaving a suspicion's history alone. The OOM observer is attached
once CUDA is initialised (``OTEL_GPU_DIAGNOSE_OOM``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from otel_gpu.core.channel import Handler
from otel_gpu.core.errors import UsageError
from otel_gpu.core.redact import redact_text
from otel_gpu.core.runtime_dir import runtime_dir
from otel_gpu.diagnose import census, cuda_memory, host_memory, memory
from otel_gpu.diagnose.memory_settings import MemorySettings
from otel_gpu.tracing import inprocess

log = logging.getLogger("otel_gpu.tracing")

OP_CENSUS = "memory.census"
OP_TRACEMALLOC = "memory.tracemalloc"
SUSPECT = "suspect"  # the agent's census on a leak suspicion: the allocator history goes on
CONFIRM = "confirm"  # the agent's census on the alert: the sites since then, history off
MAX_SAMPLES = 10
MAX_TOP = 200
OOM_CENSUS_S = 2.0  # the longest an OOM's census holds the failing allocation
OOM_HOLDERS = 5

_busy = threading.Lock()
_last: census.Census | None = None
_watch: cuda_memory.SiteWatch | None = None

Sites = Callable[[], "cuda_memory.SiteWatch | None"]


def cuda_sites(settings: MemorySettings) -> Sites:
    """This process's allocator-history watch, made once CUDA is in use; None before (and on
    CPU builds, where torch is not imported or never initialises CUDA)."""

    def get() -> cuda_memory.SiteWatch | None:
        global _watch
        if _watch is None:
            torch = sys.modules.get("torch")
            if torch is None or not cuda_memory.in_use(torch):
                return None
            _watch = cuda_memory.site_watch(torch, settings.cuda_history_max_s)
        return _watch

    return get


def _number(
    request: Mapping[str, Any], name: str, default: float, low: float, high: float
) -> float:
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number")
    return min(max(float(value), low), high)


def census_handler(settings: MemorySettings, sites: Sites | None = None) -> Handler:
    """``memory.census``; ``sites``: the allocator-history watch, when CUDA is in use."""
    sites = cuda_sites(settings) if sites is None else sites
    bounds = census.Bounds(
        max_objects=settings.census_max_objects,
        max_s=settings.census_max_s,
        max_depth=settings.census_max_depth,
    )

    def handle(request: Mapping[str, Any]) -> Mapping[str, Any]:
        global _last
        over = _number(request, "over_s", 0.0, 0.0, settings.census_max_over_s)
        samples = int(_number(request, "samples", 3, 2, MAX_SAMPLES)) if over > 0 else 1
        top = int(_number(request, "top", 20, 1, MAX_TOP))
        if not _busy.acquire(blocking=False):
            return {"error": "busy: a census is already running in this process"}
        mode = request.get("sites")  # "suspect" / "confirm" from the agent; else an interval
        watch = _sites_of(sites) if mode in (SUSPECT, CONFIRM) or over > 0 else None
        interval = None
        ranked = None
        since: str | None = None  # the growth's span, said in words for a confirmation
        try:
            try:
                if watch is not None and mode == SUSPECT:
                    watch.suspect()  # on until the confirmation, or max_s
                elif watch is not None and not (mode == CONFIRM and watch.active) and over > 0:
                    interval = watch.interval_start()
            except Exception:  # noqa: BLE001 - the census runs on without the sites
                log.debug("otel-gpu: no allocator history", exc_info=True)
            taken: list[census.Census] = []
            if request.get("baseline") == "last" and _last is not None:
                taken.append(_last)
            taken.append(census.take(bounds))
            for _ in range(samples - 1):
                time.sleep(over / (samples - 1))
                taken.append(census.take(bounds))
            _last = taken[-1]
        finally:
            # Whatever happened above: an interval's history goes off, a confirmation's too.
            try:
                if watch is not None and mode == CONFIRM and watch.active:
                    ranked, since = watch.confirm(top), "since the leak was suspected"
                elif watch is not None and interval is not None:
                    ranked, since = watch.interval_end(interval, top), None
            except Exception:  # noqa: BLE001 - the census answers without the sites
                log.debug("otel-gpu: no allocation sites", exc_info=True)
            _busy.release()
        rows = census.rank_growth(taken)
        span = taken[-1].time - taken[0].time
        reply: dict[str, Any] = {
            "pid": os.getpid(),
            "over_s": round(span, 3),
            "censuses": [c.to_dict() for c in taken],
            "holders": memory.holders_json(rows, top),
            "lines": memory.lines(rows, span)[:top],
        }
        if ranked is not None:
            reply["sites"] = ranked
            lines = cuda_memory.site_lines(ranked, None if since else span, since)
            reply["site_lines"] = lines[:top]
        elif watch is not None and watch.active:
            reply["sites_recording"] = True  # on until the confirmation asks
        return reply

    return handle


def oom_holders(settings: MemorySettings) -> Callable[[], dict[str, Any]]:
    """The largest tensor holders now, for the OOM post-mortem: one census on a thread of its
    own (it sees the failing thread's frames), at most :data:`OOM_CENSUS_S`. Returns the
    report's ``holders`` and, when the census was cut short (a bound stopped its walk, or it
    did not end in time), ``holders_note`` saying so: "none found" is then not the answer."""
    bounds = census.Bounds(
        max_objects=settings.census_max_objects,
        max_s=min(settings.census_max_s, OOM_CENSUS_S),
        max_depth=settings.census_max_depth,
    )

    def holders() -> dict[str, Any]:
        found: list[census.Census] = []
        walker = threading.Thread(
            target=lambda: found.append(census.take(bounds)), name="otel-gpu-oom-census",
            daemon=True,
        )  # fmt: skip
        walker.start()
        waited = OOM_CENSUS_S + 1.0  # its bound, and a second for the gc scan before the walk
        walker.join(waited)
        if not found:
            return {"holders": [], "holders_note": f"census did not end in {waited:g} s"}
        top = sorted(
            (h for h in found[0].holders.values() if h.path != census.UNREACHED),
            key=lambda h: -h.bytes,
        )[:OOM_HOLDERS]
        out: dict[str, Any] = {
            "holders": [
                {
                    **census.summary_holder(h),
                    "path": redact_text(h.path),
                    "site": redact_text(h.site),
                }
                for h in top
            ]
        }
        if found[0].truncated:
            out["holders_note"] = f"census cut short ({found[0].truncated})"
        return out

    return holders


def _sites_of(sites: Sites) -> cuda_memory.SiteWatch | None:
    try:
        return sites()
    except Exception:  # noqa: BLE001 - the census runs on without the sites
        log.debug("otel-gpu: no allocator history", exc_info=True)
        return None


def tracemalloc_handler(settings: MemorySettings) -> Handler:
    """``memory.tracemalloc``: the Python source lines whose allocations grew over ``over_s``
    (tracing started for the request and stopped after, unless it already ran)."""

    def handle(request: Mapping[str, Any]) -> Mapping[str, Any]:
        import tracemalloc

        over = _number(request, "over_s", 2.0, 0.0, settings.census_max_over_s)
        top = int(_number(request, "top", 10, 1, MAX_TOP))
        ours = host_memory.start()
        try:
            before = tracemalloc.take_snapshot()
            time.sleep(over)
            after = tracemalloc.take_snapshot()
        finally:
            if ours:
                tracemalloc.stop()
        return {
            "pid": os.getpid(),
            "over_s": over,
            "lines": host_memory.top_growth(before, after, top),
        }

    return handle


def register(env: Mapping[str, str] | None = None) -> bool:
    """Serve the memory operations (unless turned off); never raises into the job."""
    try:
        settings = MemorySettings.load(env)
    except UsageError as exc:
        log.warning("otel-gpu: memory attribution is off in this process: %s", exc)
        return False
    if not settings.memory_enabled:
        return False
    inprocess.register(OP_CENSUS, census_handler(settings))
    inprocess.register(OP_TRACEMALLOC, tracemalloc_handler(settings))
    if settings.oom_observer:
        try:
            cuda_memory.watch_oom(runtime_dir(), oom_holders(settings))
        except Exception as exc:  # noqa: BLE001 - the job runs on without the post-mortem
            log.debug("otel-gpu: no OOM post-mortem in this process: %s", exc)
    return True
