"""Waiting on a condition, with a deadline, instead of sleeping."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest


def wait_for_port(address: str, timeout_s: float = 30.0) -> None:
    """Return once something accepts TCP connections on ``HOST:PORT``; fail the test after
    ``timeout_s``."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on {address}")


def wait_until(what: str, probe: Callable[[], object], timeout_s: float = 60.0) -> object:
    """``probe()``'s first truthy result, polled every 0.2 s (an OSError counts as not yet);
    AssertionError naming ``what`` and the last result after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = probe()
            if last:
                return last
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")
