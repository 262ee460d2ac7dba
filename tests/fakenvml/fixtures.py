"""Pytest fixtures and helpers for the fake libnvidia-ml (imported by tests/conftest.py).

``fake_nvml_library`` (session): builds the fake once (cached by source hash under
``tests/fakenvml/build/``) and returns the path of ``libnvidia-ml.so.1``.

``fake_nvml_legacy_library`` (session) and ``legacy_nvml`` (per test): the same for the
oldest driver branch, r470 (``build_fake(..., driver="r470")``).

``nvml_driver`` (per test): ``nvml_driver("r535.43")`` is a :class:`FakeNvml` on that branch's
build (``build.DRIVERS``: its entry points, its process entry sizes).

``fake_nvml`` (per test): a :class:`FakeNvml` whose scenario file lives in ``tmp_path``; it sets
``FAKE_NVML_SCENARIO`` for this process (the fake reads it at every ``nvmlInit``) and gives
``env()`` for child processes (``LD_LIBRARY_PATH`` first, so pynvml's ``CDLL("libnvidia-ml.so.1")``
finds the fake). In this process, load the fake by absolute path:
``NvmlSource(library_path=str(fake.library))`` or ``fake.source(...)``.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .build import DRIVERS, build_fake

BUILD_DIR = Path(__file__).resolve().parent / "build"


class FakeNvml:
    """Handle on one test's fake NVML: rewrite its scenario, read its call counts."""

    def __init__(self, library: Path, directory: Path) -> None:
        self.library = library
        self.lib_dir = library.parent
        self.scenario_path = directory / "fakenvml-scenario.txt"
        self.stats_path = directory / "fakenvml-stats.txt"
        # Ramps, steps and from=/to= count from t0; fixing it here keeps them continuous
        # across rewrites of the scenario.
        self.t0 = time.time()
        self.text = ""
        self._lib = ctypes.CDLL(str(library))  # same object pynvml gets via library_path
        self._lib.fakenvml_call_count.restype = ctypes.c_ulonglong
        self._lib.fakenvml_call_count.argtypes = [ctypes.c_char_p]
        self._lib.fakenvml_call_count_dev.restype = ctypes.c_ulonglong
        self._lib.fakenvml_call_count_dev.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self._lib.fakenvml_last_error.restype = ctypes.c_char_p
        self._sources: list[Any] = []

    def write(self, text: str) -> None:
        """Replace the scenario (see tests/fakenvml/README.md); takes effect at once here and
        within 10 ms in child processes. Raises ValueError when the fake cannot parse it."""
        self.text = textwrap.dedent(text).strip() + "\n"
        tmp = self.scenario_path.with_suffix(".tmp")
        tmp.write_text(f"t0 = {self.t0!r}\n{self.text}")
        os.replace(tmp, self.scenario_path)  # atomic: a reader never sees half a file
        if self._lib.fakenvml_reload() != 0:
            error = (self._lib.fakenvml_last_error() or b"").decode()
            raise ValueError(f"fake NVML rejected the scenario: {error}")

    def append(self, text: str) -> None:
        """Add lines to the scenario (later lines win), e.g. ``fail.*.1 = GPU_IS_LOST``."""
        self.write(self.text + textwrap.dedent(text).strip() + "\n")

    def call_count(self, symbol: str = "*", gpu: int | None = None) -> int:
        """Calls of ``symbol`` (exported NVML name, ``*`` = all) in this process, on ``gpu``
        (None: all GPUs and device-less calls; -1: device-less calls only)."""
        if gpu is None:
            return int(self._lib.fakenvml_call_count(symbol.encode()))
        return int(self._lib.fakenvml_call_count_dev(symbol.encode(), gpu))

    def reset_counts(self) -> None:
        self._lib.fakenvml_reset_counts()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process that must load the fake through pynvml."""
        env = dict(os.environ if base is None else base)
        paths = [str(self.lib_dir), *filter(None, env.get("LD_LIBRARY_PATH", "").split(":"))]
        env["LD_LIBRARY_PATH"] = ":".join(paths)
        env["FAKE_NVML_SCENARIO"] = str(self.scenario_path)
        env["FAKE_NVML_STATS"] = str(self.stats_path)
        return env

    def run_python(self, code: str) -> list[str]:
        """Run ``code`` in a child Python whose pynvml loads the fake by name (through
        ``env()``); the words it printed. Fails the test if the child fails."""
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    def child_stats(self) -> dict[tuple[str, int], int]:
        """Call counts a child process wrote at its last nvmlShutdown / exit:
        {(symbol, gpu): count}, gpu -1 for device-less calls."""
        stats: dict[tuple[str, int], int] = {}
        if self.stats_path.exists():
            for line in self.stats_path.read_text().splitlines():
                symbol, gpu, count = line.split()
                stats[(symbol, int(gpu))] = int(count)
        return stats

    def source(self, **kwargs: Any) -> Any:
        """An ``NvmlSource`` on the fake (closed at teardown); kwargs go to its constructor."""
        from otel_gpu.sampling.nvml import NvmlSource

        kwargs.setdefault("call_timeout_s", 1.0)
        kwargs.setdefault("library_path", str(self.library))
        src = NvmlSource(**kwargs)
        self._sources.append(src)
        return src

    def close(self) -> None:
        for src in self._sources:
            src.close()


@pytest.fixture(scope="session")
def fake_nvml_library() -> Path:
    """Path of the compiled fake ``libnvidia-ml.so.1`` (built once, cached by source hash)."""
    return build_fake(BUILD_DIR)


@pytest.fixture(scope="session")
def fake_nvml_legacy_library() -> Path:
    """Path of the fake built as the oldest driver branch (r470)'s ``libnvidia-ml.so.1``."""
    return build_fake(BUILD_DIR, driver="r470")


def _fake(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    fake = FakeNvml(library, tmp_path)
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(fake.scenario_path))
    fake.write("devices = 2")
    fake.reset_counts()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def fake_nvml(
    fake_nvml_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvml]:
    """A fake NVML with two default GPUs; ``write()`` a scenario to change it."""
    yield from _fake(fake_nvml_library, tmp_path, monkeypatch)


@pytest.fixture
def legacy_nvml(
    fake_nvml_legacy_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvml]:
    """:func:`fake_nvml` on the r470 build (an older driver)."""
    yield from _fake(fake_nvml_legacy_library, tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def fake_nvml_driver_libraries() -> dict[str, Path]:
    """Every driver branch's build of the fake (``build.DRIVERS``), by branch name."""
    return {branch: build_fake(BUILD_DIR, driver=branch) for branch in DRIVERS}


@pytest.fixture
def nvml_driver(
    fake_nvml_driver_libraries: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], FakeNvml]]:
    """``nvml_driver(branch)``: :func:`fake_nvml` on the build of that driver branch (one a
    test: the fake reads ``$FAKE_NVML_SCENARIO``, which names the last one made)."""
    opened: list[Iterator[FakeNvml]] = []

    def make(branch: str) -> FakeNvml:
        directory = tmp_path / branch
        directory.mkdir()
        fakes = _fake(fake_nvml_driver_libraries[branch], directory, monkeypatch)
        opened.append(fakes)
        return next(fakes)

    yield make
    for fakes in opened:
        next(fakes, None)  # closes its sources
