"""Memory diagnosis as people read it: the growing holders of a census series as lines and as
plain data (pure; issue 20 §2-§4). The holder rows come from
:func:`otel_gpu.diagnose.census.rank_growth`, here or over the control channel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from otel_gpu.core.redact import redact_text

KIND = "memory"  # Diagnosis.kind of a memory diagnosis
SHOWN = 3  # holders a notifier's text shows


def size(n: float) -> str:
    """``512 B``, ``3.1 KiB``, ``20.0 MiB``, ``1.2 GiB`` (signed with ``sign``)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{n:.0f} B"


def growing(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of holders that grew in every interval, largest growth first."""
    return [r for r in rows if r.get("growing")]


def holder_line(row: Mapping[str, Any], over_s: float | None = None) -> str:
    """``train.history: +120 tensors, +480.0 KiB in 30 s (now 600, 2.3 MiB; float32 on cpu;
    autograd graphs alive) — global in train.py``."""
    span = f" in {over_s:.0f} s" if over_s else ""
    kinds = "/".join(sorted(row.get("dtypes") or {})) or "?"
    devices = "/".join(sorted(row.get("devices") or {})) or "?"
    graphs = "; autograd graphs alive" if row.get("grad_fn") else ""
    where = f"{row.get('root', '?')} in {row.get('site', '?')}"
    text = (
        f"{row['path']}: {row['growth_count']:+d} tensors, +{size(row['growth_bytes'])}{span} "
        f"(now {row['count']}, {size(row['bytes'])}; {kinds} on {devices}{graphs}) — {where}"
    )
    return redact_text(text)


def lines(rows: Sequence[Mapping[str, Any]], over_s: float | None = None) -> list[str]:
    """One line per growing holder, most growth first; one line saying so when none grew."""
    found = growing(rows)
    if not found:
        return []
    return [holder_line(r, over_s) for r in found]


def holders_json(rows: Sequence[Mapping[str, Any]], limit: int = 20) -> list[dict[str, Any]]:
    """The rows as ``diagnose memory --json`` and the alert's data give them (redacted)."""
    out = []
    for r in rows[:limit]:
        out.append(
            {
                "path": redact_text(str(r["path"])),
                "root": r.get("root"),
                "site": redact_text(str(r.get("site") or "")) or None,
                "count": r["count"],
                "bytes": r["bytes"],
                "grad_fn": r.get("grad_fn", 0),
                "growth_count": r["growth_count"],
                "growth_bytes": r["growth_bytes"],
                "growing": bool(r.get("growing")),
                "devices": dict(r.get("devices") or {}),
                "dtypes": dict(r.get("dtypes") or {}),
            }
        )
    return out
