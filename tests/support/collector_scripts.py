"""The shipped ``collector-config/*.sh`` scripts as child processes."""

from __future__ import annotations

import os
import signal
import subprocess

from support.paths import ROOT

SCRIPTS = ROOT / "collector-config"


def start_script(script: str, env: dict[str, str], log: str) -> subprocess.Popen:
    """``sh collector-config/SCRIPT`` in its own session, its output written to ``log``."""
    return subprocess.Popen(
        ["sh", str(SCRIPTS / script)],
        env=env,
        stdout=open(log, "wb"),  # noqa: SIM115 - the child holds it
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a stray child would show in its own session only
    )


def stop_script(proc: subprocess.Popen) -> int:
    """SIGTERM to the script, SIGKILL to its whole session if it has not ended 20 s later;
    its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(5)
