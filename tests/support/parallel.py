"""Running the suite in parallel workers (pytest-xdist; pyproject's ``-n auto``):
how many, what each worker keeps to itself, and which tests must share one. A pytest plugin
(tests/conftest.py lists it)."""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Most tests wait on child processes and peers far more than they compute. `-m process` on the
# idle 2-core VM, back to back: 185 s in one process, 101 s with 2 workers, 80 s with 3, 79 s
# with 4; 3 it is (fewer CPU-bound tests side by side than 4), never fewer than the CPUs.
WORKERS = max(3, os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-m unit`` (in-process, CPU-bound) gets one worker per CPU; anything else WORKERS.
    PYTEST_XDIST_AUTO_NUM_WORKERS, or ``-n N``, still decides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    if config.option.markexpr.strip() == "unit":
        return os.cpu_count() or 1
    return WORKERS


def pytest_configure(config: pytest.Config) -> None:
    """A private TMPDIR for this test process and its children, so the default node lock
    (``$TMPDIR/otel-gpu-<uid>``, otel_gpu/agent/node_lock.py) is each worker's own: parallel
    workers, and other test sessions on the machine, never take each other's node. pytest's
    own temp root stays where it was (PYTEST_DEBUG_TEMPROOT)."""
    root = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    os.environ["PYTEST_DEBUG_TEMPROOT"] = root
    private = tempfile.mkdtemp(prefix="otel-gpu-tests-", dir=root)
    os.environ["TMPDIR"] = private
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.add_cleanup(lambda: shutil.rmtree(private, ignore_errors=True))


def modules_with_shared_fixtures(tests: Path, rootdir: Path) -> set[str]:
    """The test modules (paths as in node ids) that define a module- or package-scoped
    fixture: set up once per process that runs the module's tests."""
    shared = set()
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.keyword)
                and node.arg == "scope"
                and isinstance(node.value, ast.Constant)
                and node.value.value in SHARED_SCOPES
            ):
                shared.add(path.relative_to(rootdir).as_posix())
    return shared


SHARED_SCOPES = ("module", "package", "session")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load scheduling, one test at a time, except that the tests of a module with a
    module-scoped fixture (a Prometheus stack, a recorded report, a tiny model) go to one
    worker together, so that the fixture is set up once. (``xdist_group`` would say the same
    per test, but xdist 3.8 cannot set the group on pytest 9's node ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    shared = modules_with_shared_fixtures(config.rootpath / "tests", config.rootpath)

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in shared else nodeid

    return SharedFixtureScheduling(config, log)
