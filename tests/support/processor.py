"""``otel-gpu processor`` as a child process, and the agent series it is fed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from otel_gpu.processor.settings import ProcessorConfig
from support.paths import ROOT
from support.synth import GIB, agent_request, default_value


def in_process_config(**settings: object) -> ProcessorConfig:
    """The settings of a processor run inside the test runner: listening on a free loopback
    port, its memory limit off. That limit reads the resident memory of the whole runner (torch
    and what earlier tests left included), not the processor's own; its tests inject a reading."""
    return ProcessorConfig(**{"listen": "127.0.0.1:0", "memory_limit_mib": 0, **settings})  # type: ignore[arg-type]


def processor_cli(*args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    """``otel-gpu processor ARGS`` to completion with only the given OTEL_GPU_* ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_")}
    return subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "processor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**env, **variables},
    )


def leak_requests(
    n: int,
    *,
    start_s: float | None = None,
    step_s: float = 15.0,
    rate_bytes_per_s: float = 1.33e6,
    instance: str = "run-1",
    first: int = 0,
) -> Iterator[bytes]:
    """A small agent (1 GPU, 1 process) whose process leaks GPU memory steadily."""
    t0 = time.time() - 6 * 3600 if start_s is None else start_s
    for k in range(first, first + n):
        t = t0 + k * step_s

        def value(metric: str, i: int, extra: dict[str, str], t: float = t) -> float | None:
            if metric == "process.gpu.memory.usage":
                return 7 * GIB + (t - t0) * rate_bytes_per_s
            if metric == "hw.gpu.memory.usage":
                return 20 * GIB + (t - t0) * rate_bytes_per_s
            return default_value(metric, i, extra)

        yield agent_request(
            int(t * 1e9), gpus=1, processes=1, instance=instance, value=value
        ).SerializeToString()


class ProcessorProcess:
    """``otel-gpu processor`` as a child process; waits for its ready line."""

    READY = re.compile(r"listening on ([^\s;]+)")

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        # Only the settings the test gives: none leak in from the developer's shell.
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_gpu.cli", "processor", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=full_env,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                m = self.READY.search(line)
                if m and not ready.is_set():
                    self.address = m.group(1)
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(30) or not self.address:
            self.kill()
            raise AssertionError("processor did not start:\n" + "".join(self.lines))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)
