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
error is raised, possibly several times: it writes ``<runtime dir>/oom-<pid>.json`` once.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from typing import Any

UNATTRIBUTED = "(unattributed)"
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
    return rows[:top]


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
        "sites": [{"site": s, "blocks": n, "bytes": b} for s, (n, b) in top],
    }


# -- the torch-facing part (guarded) ----------------------------------------------------------


def history_on(torch: Any, max_entries: int = 100_000) -> bool:
    """Switch the CUDA allocator history on (cheapest mode); False where it cannot be."""
    try:
        if not torch.cuda.is_available():
            return False
        torch.cuda.memory._record_memory_history(  # noqa: SLF001
            enabled="state", context="alloc", stacks="python", max_entries=max_entries
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


def oom_observer(
    runtime_dir: str, take_snapshot: Callable[[], Mapping[str, Any] | None], pid: int
) -> Callable[[int, int, int, int], None]:
    """The observer PyTorch calls before raising an OOM: writes ``oom-<pid>.json`` once;
    never raises (it runs inside the allocator's error path)."""
    written: list[bool] = []

    def observe(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        if written:
            return  # called again for the same OOM (retries): the first look is the one
        written.append(True)
        try:
            snap = take_snapshot() or {}
            report = oom_report(device, alloc, device_alloc, device_free, snap)
            path = os.path.join(runtime_dir, f"oom-{pid}.json")
            tmp = f"{path}.tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(report, f)
            os.replace(tmp, path)
        except Exception:  # noqa: BLE001 - the job's OOM error must propagate, not ours
            pass

    return observe


def attach_oom_observer(torch: Any, runtime_dir: str) -> bool:
    """Attach :func:`oom_observer` where CUDA is in use; False on CPU builds or without CUDA."""
    try:
        attach = torch._C._cuda_attach_out_of_memory_observer  # noqa: SLF001
        if not torch.cuda.is_available():
            return False
    except AttributeError:
        return False
    attach(oom_observer(runtime_dir, lambda: snapshot(torch), os.getpid()))
    return True
