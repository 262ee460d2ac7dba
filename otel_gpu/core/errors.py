"""User-facing errors: one line that names the problem and the fix, no traceback."""

from __future__ import annotations


class UsageError(Exception):
    """A mistake in how otel-gpu was invoked or configured (exit code 2)."""

    exit_code = 2
