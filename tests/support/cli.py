"""The ``otel-gpu`` command line as a child process: its argv, a clean environment, one call."""

from __future__ import annotations

import os
import re
import subprocess
import sys

CLI = [sys.executable, "-m", "otel_gpu.cli"]


def otel_gpu(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``otel-gpu ARGS`` to completion, output captured; a clean environment unless ``env``."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env or clean_env()
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any OTEL_* or FAKE_NVML* variable (none leaks in
    from the developer's shell), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FAKE_NVML"))}
    env.update(extra)
    return env


# gRPC's C core writes lines such as "E1201 12:00:00.000000 123 add_port.cc:83] ...".
GRPC_CORE_LINE = re.compile(r"^[EWID]\d{4} ", re.M)
