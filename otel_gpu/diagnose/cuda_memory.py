"""GPU allocation sites and the OOM post-mortem (issue 20 §2), pure where it can be.

The pure part works on snapshot dicts in the format ``torch.cuda.memory._snapshot()``
documents: ``segments[].blocks[]{size, requested_size, state, frames[{filename, line,
name}]}``. An allocation's *site* is its first frame outside torch, site-packages and the
standard library (``train.py:41 in forward``); blocks without frames (allocated before the
history was on, or by C++) are one "unattributed" row.

The torch-facing part is guarded: on CPU builds (no ``_record_memory_history``, no OOM
observer: AttributeError) and without CUDA each call does nothing and says so (False/None).
Allocator history is switched on in its cheapest useful mode (``enabled="state"``,
``context="alloc"``, ``stacks="python"``: Python frames at allocations only, ~2 us each) and
off again with ``enabled=None`` (which also clears it). The OOM observer runs before the OOM
error is raised, possibly several times for one OOM: it writes ``<runtime
dir>/oom-<pid>-<n>.json`` (our table) and ``oom-<pid>-<n>.pickle`` (the allocator snapshot,
which PyTorch's memory viewer loads) once per OOM, at most three a process, and logs the alert.

Wiring (:mod:`otel_gpu.tracing.memory_ops`): a :class:`SiteWatch` per process switches the
history on at a leak suspicion's baseline census (or for the interval of one ``diagnose
memory``), ranks the sites at the confirming census and switches it off then, or after
``OTEL_GPU_DIAGNOSE_CUDA_HISTORY_MAX_S`` at the latest; :func:`watch_oom` attaches the observer
as soon as ``torch`` is imported and CUDA initialised, nothing before (no allocation is slowed).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_gpu.core.redact import redact_text
from otel_gpu.diagnose.memory import size

log = logging.getLogger("otel_gpu.actions")

UNATTRIBUTED = "(unattributed)"
MAX_OOM_REPORTS = 3  # post-mortems one process writes at most
OOM_RETRY_S = 5.0  # the same request again within this is the same OOM
LIVE_STATES = ("active_allocated",)
_LIBRARY_MARKERS = ("site-packages", "dist-packages", "/torch/", "<frozen")


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(p for p in {paths.get("stdlib"), paths.get("platstdlib")} if p)


def site_of(frames: Sequence[Mapping[str, Any]], library: tuple[str, ...] | None = None) -> str:
    """``train.py:41 in forward`` for the first frame of the program's own code, innermost
    first as the snapshot lists them; :data:`UNATTRIBUTED` when there is none."""
    library = _library_roots() if library is None else library
    for f in frames:
        name = str(f.get("filename") or "")
        if not name or any(m in name for m in _LIBRARY_MARKERS) or name.startswith(library):
            continue
        return f"{os.path.basename(name)}:{f.get('line', '?')} in {f.get('name', '?')}"
    return UNATTRIBUTED


def live_by_site(snapshot: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """site -> (live blocks, live bytes) of a snapshot."""
    out: dict[str, tuple[int, int]] = {}
    library = _library_roots()
    for segment in snapshot.get("segments") or ():
        for block in segment.get("blocks") or ():
            if block.get("state") not in LIVE_STATES:
                continue
            site = site_of(block.get("frames") or (), library)
            n, b = out.get(site, (0, 0))
            out[site] = (n + 1, b + int(block.get("size") or 0))
    return out


def rank_sites(
    before: Mapping[str, Any], after: Mapping[str, Any], top: int = 20
) -> list[dict[str, Any]]:
    """Allocation sites by growth of live bytes from ``before`` to ``after``, largest first."""
    a, b = live_by_site(before), live_by_site(after)
    rows: list[dict[str, Any]] = []
    for site in set(a) | set(b):
        n0, b0 = a.get(site, (0, 0))
        n1, b1 = b.get(site, (0, 0))
        rows.append(
            {
                "site": site,
                "blocks": n1,
                "bytes": b1,
                "growth_blocks": n1 - n0,
                "growth_bytes": b1 - b0,
            }
        )
    rows.sort(key=lambda r: (-r["growth_bytes"], -r["bytes"], r["site"]))
    for r in rows[:top]:
        r["site"] = redact_text(r["site"])  # a file name and a function: redacted like holders
    return rows[:top]


def site_line(row: Mapping[str, Any], over_s: float | None = None, since: str | None = None) -> str:
    """``GPU memory allocated at model.py:12 in forward: +10.0 MiB in +5 blocks in 30 s (now
    12.0 MiB live)``; ``since`` in place of the interval (``since the leak was suspected``)."""
    span = f" {since}" if since else f" in {over_s:.0f} s" if over_s else ""
    return redact_text(
        f"GPU memory allocated at {row['site']}: +{size(row['growth_bytes'])} in "
        f"{row['growth_blocks']:+d} blocks{span} (now {size(row['bytes'])} live)"
    )


def site_lines(
    rows: Sequence[Mapping[str, Any]], over_s: float | None = None, since: str | None = None
) -> list[str]:
    """One line per site whose live bytes grew, most growth first."""
    return [site_line(r, over_s, since) for r in rows if r["growth_bytes"] > 0]


class SiteWatch:
    """The allocator history of this process's leak attribution (pure but for the injected
    calls; thread-safe).

    ``on`` switches the history on (False: it cannot be), ``off`` switches it off, ``take``
    returns a snapshot dict; ``clock`` is monotonic seconds; ``timer(seconds, fn)`` runs ``fn``
    once later and returns something with ``cancel()`` (a daemon :class:`threading.Timer` by
    default).

    A *suspicion* (:meth:`suspect`) switches the history on and keeps a baseline until
    :meth:`confirm` ranks the sites grown since and switches it off — or until ``max_on_s``
    passes (a suspicion never confirmed), when the timer switches it off. An *interval*
    (:meth:`interval_start` / :meth:`interval_end`, one ``diagnose memory --over``) ranks the
    growth over that interval only: it switches the history on and off again itself when no
    suspicion has it on, and leaves a suspicion's history and baseline alone.
    """

    def __init__(
        self,
        on: Callable[[], bool],
        off: Callable[[], bool],
        take: Callable[[], Mapping[str, Any] | None],
        max_on_s: float,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[float, Callable[[], None]], Any] | None = None,
    ) -> None:
        self._on, self._off, self._take = on, off, take
        self.max_on_s = max_on_s
        self._clock = clock
        self._timer = timer or _daemon_timer
        self._lock = threading.Lock()
        self._baseline: Mapping[str, Any] | None = None  # the suspicion's
        self._since: float | None = None
        self._expiry: Any = None
        self._intervals = 0  # intervals running that switched the history on themselves

    @property
    def active(self) -> bool:
        """Is a suspicion's history on?"""
        return self._since is not None

    def _switch_on(self) -> Mapping[str, Any] | None:
        """History on and a first snapshot; None (and the history off) when either fails."""
        if not self._on():
            return None
        try:
            return self._take() or {}
        except Exception:
            self._off()
            raise

    def suspect(self) -> bool:
        """A suspicion's history on, its baseline kept (again while on: nothing)."""
        with self._lock:
            if self._since is not None:
                return True
            if self._intervals:
                return False  # an interval has it on: its end switches it off
            baseline = self._switch_on()
            if baseline is None:
                return False
            self._baseline, self._since = baseline, self._clock()
            since = self._since
            self._expiry = self._timer(self.max_on_s, lambda: self._expire_if(since))
            return True

    def confirm(self, top: int = 20) -> list[dict[str, Any]] | None:
        """The sites grown since the suspicion, history off; None without a suspicion."""
        with self._lock:
            if self._since is None:
                return None
            baseline = self._baseline or {}
            try:
                now = self._take() or {}
            finally:
                self._stop()
            return rank_sites(baseline, now, top)

    def expire(self) -> bool:
        """Off when the suspicion's history has been on ``max_on_s``; True when it went off."""
        with self._lock:
            if self._since is None or self._clock() - self._since < self.max_on_s:
                return False
            self._stop()
            return True

    def _expire_if(self, since: float) -> None:
        """The timer's end of the suspicion that began at ``since`` (not of a later one)."""
        with self._lock:
            if self._since == since:
                self._stop()

    def interval_start(self) -> tuple[Mapping[str, Any], bool] | None:
        """(baseline, switched on by this interval) for :meth:`interval_end`; None when the
        history cannot be on."""
        with self._lock:
            if self._since is not None or self._intervals:
                return (self._take() or {}), False
            baseline = self._switch_on()
            if baseline is None:
                return None
            self._intervals += 1
            return baseline, True

    def interval_end(
        self, start: tuple[Mapping[str, Any], bool], top: int = 20
    ) -> list[dict[str, Any]]:
        """The sites grown since ``start``; the history off again if that interval put it on."""
        baseline, ours = start
        with self._lock:
            try:
                now = self._take() or {}
            finally:
                if ours:
                    self._intervals -= 1
                    if not self._intervals and self._since is None:
                        self._off()
            return rank_sites(baseline, now, top)

    def _stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._baseline, self._since, self._expiry = None, None, None
        if not self._intervals:
            self._off()


def _daemon_timer(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.name = "otel-gpu-cuda-history"
    timer.start()
    return timer


# -- the torch-facing part (guarded) ----------------------------------------------------------


def history_on(torch: Any) -> bool:
    """Switch the CUDA allocator history on (cheapest mode); False where it cannot be, or
    where the job records its own history (``_cuda_isHistoryEnabled``): we neither change its
    mode nor switch it off under it."""
    try:
        if not torch.cuda.is_available():
            return False
        if torch._C._cuda_isHistoryEnabled():  # noqa: SLF001
            return False
        torch.cuda.memory._record_memory_history(  # noqa: SLF001
            enabled="state", context="alloc", stacks="python"
        )
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


def history_off(torch: Any) -> bool:
    try:
        if not torch.cuda.is_available():
            return False
        torch.cuda.memory._record_memory_history(enabled=None)  # noqa: SLF001
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


def snapshot(torch: Any) -> dict[str, Any] | None:
    try:
        if not torch.cuda.is_available():
            return None
        return dict(torch.cuda.memory._snapshot())  # noqa: SLF001
    except (AttributeError, RuntimeError, TypeError):
        return None


def oom_report(
    device: int, alloc: int, device_alloc: int, device_free: int, snapshot: Mapping[str, Any]
) -> dict[str, Any]:
    """What an OOM post-mortem file holds: the failed request and the top live sites."""
    sites = live_by_site(snapshot)
    top = sorted(sites.items(), key=lambda kv: -kv[1][1])[:20]
    return {
        "device": device,
        "requested_bytes": alloc,
        "device_allocated_bytes": device_alloc,
        "device_free_bytes": device_free,
        "sites": [{"site": redact_text(s), "blocks": n, "bytes": b} for s, (n, b) in top],
    }


def _write_private(path: str, write: Callable[[Any], None], mode: str) -> None:
    """``path`` whole or not at all (a temporary file renamed), readable by this user only."""
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), mode) as f:
        write(f)
    os.replace(tmp, path)


def oom_alert_line(pid: int, report: Mapping[str, Any], path: str) -> str:
    """The OOM post-mortem as the alert's one line (the top three holders and live sites)."""
    sites = ", ".join(f"{s['site']} ({size(s['bytes'])})" for s in report["sites"][:3])
    held = ", ".join(
        f"{h['path']} ({size(h['bytes'])} in {h['count']} tensors)"
        for h in report.get("holders", [])[:3]
    )
    held = held or "none found"
    if report.get("holders_note"):
        held += f" ({report['holders_note']})"
    return redact_text(
        f"otel-gpu ALERT: oom (warning) on pid {pid}: CUDA out of memory on device "
        f"{report['device']} asking {size(report['requested_bytes'])} "
        f"({size(report['device_free_bytes'])} free), raised to the job (it may catch it); "
        f"largest holders: {held}; largest live allocation sites: "
        f"{sites or 'none recorded'}; post-mortem {path}"
    )


def oom_observer(
    runtime_dir: str,
    take_snapshot: Callable[[], Mapping[str, Any] | None],
    pid: int,
    holders: Callable[[], dict[str, Any]] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[int, int, int, int], None]:
    """The observer PyTorch calls before raising an OOM: writes ``oom-<pid>-<n>.json`` (our
    table: the request, the top live sites and, from ``holders``, the largest tensor holders)
    and ``oom-<pid>-<n>.pickle`` (the snapshot, for PyTorch's memory viewer, written by a
    thread of its own after the table) and logs the alert. At most :data:`MAX_OOM_REPORTS` a
    process (a job may catch OOMs: a batch-size search, cuDNN's workspace tries); a call for
    the same request within :data:`OOM_RETRY_S` is the allocator retrying the same OOM and is
    skipped. Never raises (it runs inside the allocator's error path)."""
    guard = threading.Lock()
    state: dict[str, Any] = {"n": 0, "last": None}

    def observe(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        if not guard.acquire(blocking=False):
            return  # another thread's OOM is being written
        try:
            now = clock()
            last = state["last"]
            if last is not None and last[0] == (device, alloc) and now - last[1] < OOM_RETRY_S:
                return  # the same OOM again (the allocator retried after freeing its cache)
            if state["n"] >= MAX_OOM_REPORTS:
                return
            state["n"] += 1
            state["last"] = ((device, alloc), now)
            snap = take_snapshot() or {}
            report = oom_report(device, alloc, device_alloc, device_free, snap)
            try:
                report.update(holders() if holders is not None else {"holders": []})
            except Exception:  # noqa: BLE001 - the sites are written without them
                report["holders"] = []
            stem = os.path.join(runtime_dir, f"oom-{pid}-{state['n']}")
            _write_private(f"{stem}.json", lambda f: json.dump(report, f), "w")
            log.error("%s", oom_alert_line(pid, report, f"{stem}.json"))
            if snap:  # large with history on: off the failing thread
                threading.Thread(
                    target=_write_viewer_file, args=(f"{stem}.pickle", snap),
                    name="otel-gpu-oom-snapshot", daemon=True,
                ).start()  # fmt: skip
        except Exception:  # noqa: BLE001 - the job's OOM error must propagate, not ours
            pass
        finally:
            guard.release()

    return observe


def _write_viewer_file(path: str, snap: Mapping[str, Any]) -> None:
    try:
        _write_private(path, lambda f: pickle.dump(dict(snap), f), "wb")
    except Exception:  # noqa: BLE001 - the table is written; the viewer file is a bonus
        log.debug("otel-gpu: OOM snapshot not written", exc_info=True)


def attach_oom_observer(
    torch: Any, runtime_dir: str, holders: Callable[[], dict[str, Any]] | None = None
) -> bool:
    """Attach :func:`oom_observer` where CUDA is in use; False on CPU builds or without CUDA."""
    try:
        attach = torch._C._cuda_attach_out_of_memory_observer  # noqa: SLF001
        if not torch.cuda.is_available():
            return False
    except AttributeError:
        return False
    attach(oom_observer(runtime_dir, lambda: snapshot(torch), os.getpid(), holders))
    return True


def in_use(torch: Any) -> bool:
    """Has this process initialised CUDA (so a snapshot is cheap and says something)?"""
    try:
        return bool(torch.cuda.is_initialized())
    except (AttributeError, RuntimeError, TypeError):
        return False


def site_watch(torch: Any, max_on_s: float) -> SiteWatch:
    """A :class:`SiteWatch` on the real allocator of ``torch``."""
    return SiteWatch(
        lambda: history_on(torch),
        lambda: history_off(torch),
        lambda: snapshot(torch),
        max_on_s,
    )


def _attach_quietly(
    torch: Any, runtime_dir: str, holders: Callable[[], dict[str, Any]] | None
) -> None:
    """:func:`attach_oom_observer` from inside torch's CUDA initialisation, where an exception
    would fail the job's first CUDA call (``DeferredCudaCallError``): none leaves."""
    try:
        attach_oom_observer(torch, runtime_dir, holders)
    except Exception:  # noqa: BLE001 - the job runs on without the post-mortem
        log.debug("otel-gpu: no OOM observer", exc_info=True)


def watch_oom(runtime_dir: str, holders: Callable[[], dict[str, Any]] | None = None) -> None:
    """Attach the OOM observer once ``torch`` is imported and CUDA initialised (now, when both
    already are); never raises, and does nothing on CPU builds."""
    import wrapt

    def imported(torch: Any) -> None:
        # Runs at the end of the job's `import torch`: nothing may leave here either.
        try:
            attach = functools.partial(_attach_quietly, torch, runtime_dir, holders)
            torch.cuda._lazy_call(attach)  # noqa: SLF001 - now, or at CUDA's initialisation
        except Exception:  # noqa: BLE001 - the job runs on without the post-mortem
            log.debug("otel-gpu: no OOM observer", exc_info=True)

    wrapt.register_post_import_hook(imported, "torch")
