"""Waiting on a condition, with a deadline, instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for_port(address: str, timeout_s: float = 30.0) -> None:
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on {address}")


def wait_until(what: str, probe: Callable[[], object], timeout_s: float = 60.0) -> object:
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
