"""Host memory of the trainer by source line (issue 20 §2): ``tracemalloc`` snapshots compared
by line (``Snapshot.compare_to('lineno')``). It sees Python-allocated memory only, not tensor
storage (c10 allocates that; the census counts CPU tensors). Tracing costs every Python
allocation while on, so it is started on demand (a suspicion, a request) and stopped after.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

from otel_gpu.core.redact import redact_text


def start(frames: int = 1) -> bool:
    """Start tracing (True) unless it already runs (False: someone else's, left as it is)."""
    if tracemalloc.is_tracing():
        return False
    tracemalloc.start(frames)
    return True


def top_growth(
    before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int = 10
) -> list[dict[str, Any]]:
    """Source lines by growth of traced bytes, largest first (growing lines only)."""
    keep = (
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
        tracemalloc.Filter(False, "<unknown>"),
    )
    a, b = before.filter_traces(keep), after.filter_traces(keep)
    rows = []
    for stat in b.compare_to(a, "lineno"):
        if stat.size_diff <= 0:
            continue
        frame = stat.traceback[0]
        rows.append(
            {
                "site": redact_text(f"{frame.filename}:{frame.lineno}"),
                "bytes": stat.size,
                "growth_bytes": stat.size_diff,
                "count": stat.count,
                "growth_count": stat.count_diff,
            }
        )
        if len(rows) >= top:
            break
    return rows
