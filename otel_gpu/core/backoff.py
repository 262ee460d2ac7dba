"""The one exponential backoff every retry loop uses: bounded at any attempt number.

``base * 2 ** attempt`` overflows a float at attempt 1024 (``OverflowError``) and a retry loop
that runs long enough gets there: a forwarder retrying through a long outage, a loop whose
waits are cut short. Here the exponent is capped before it is raised, so any attempt number,
however large, gives a finite delay no longer than ``cap``.
"""

from __future__ import annotations

import math

_MAX_EXPONENT = 30  # 2**30 times any sane base is far past any cap


def exponential(attempt: int, base: float, cap: float) -> float:
    """``base * 2 ** attempt`` seconds, at most ``cap``, for any ``attempt`` (0-based; a
    negative one counts as 0)."""
    step = min(max(int(attempt), 0), _MAX_EXPONENT)
    delay = base * math.ldexp(1.0, step)
    return min(delay, cap) if math.isfinite(delay) else cap
