"""A real peer server as a child process for tests: started, waited for, stopped, its log kept.

:class:`PeerProcess` starts ``argv`` with its output in ``<folder>/<name>.log``, polls
``ready_url`` until it answers 200 (failing the test with the log's tail when the process exits
or the deadline passes), and on exit terminates it, then kills it if it lingers. The peers
(tests/support/prometheus_peer.py, tests/support/phoenix_peer.py) add their own query helpers.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest


class PeerProcess:
    """One server process of a peer named ``name`` (for messages and its log file)."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(
        self,
        argv: Sequence[str],
        ready_url: str,
        *,
        startup_s: float,
        poll_s: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Run ``argv`` and return once ``ready_url`` answers 200; fail the test otherwise."""
        self._log = open(self.folder / f"{self.name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                pytest.fail(f"{self.name} exited: {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(ready_url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(poll_s)
        self.stop()
        pytest.fail(f"{self.name} did not become ready within {startup_s} s: {self.log()[-2000:]}")

    def stop(self, *_exc: Any) -> None:
        """Terminate, then kill after 15 s; close the log."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._log is not None:
            self._log.close()

    def log(self) -> str:
        return (self.folder / f"{self.name}.log").read_text(errors="replace")
