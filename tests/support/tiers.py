"""The three test tiers (docs/development.md), and the hooks that hold them.

``unit``: in-process and fast; ``process``: starts child processes or opens real sockets;
``peers``: real external peers (Prometheus, Phoenix, rotel, Chromium, swift, torchrun,
kubectl and docker-compose validation) or longer than about 5 s. Every test carries exactly one
(a module's ``pytestmark``, or per test where a module mixes); tests/conftest.py imports the
hooks below.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

# urllib3 binds ::1 once, at import, to learn whether IPv6 works: imported here, before any
# test, so that the first unit test to import it (through transformers) is not blamed.
with contextlib.suppress(ImportError):
    import urllib3.util.connection  # noqa: F401

TIERS = ("unit", "process", "peers")  # fastest first
UNTIERED = pytest.StashKey[list[str]]()  # "nodeid: tiers" of each test without exactly one


def tiers_of(item: pytest.Item) -> list[str]:
    return [m.name for m in item.iter_markers() if m.name in TIERS]


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the rule holds for every collected test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Record the tests without exactly one tier (tests/test_suite_layout.py fails on them),
    and run the slow tiers first: with parallel workers the long tests start at once instead
    of ending the run alone. A module's tests stay together (its fixtures are set up once)."""
    untiered = []
    module_rank: dict[object, int] = {}
    for item in items:
        tiers = tiers_of(item)
        if len(tiers) != 1:
            untiered.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier'}")
        rank = -max((TIERS.index(t) for t in tiers), default=0)
        module_rank[item.path] = min(module_rank.get(item.path, 0), rank)
    config.stash[UNTIERED] = untiered
    items.sort(key=lambda item: module_rank[item.path])  # stable: a module's order is kept


@pytest.fixture(autouse=True)
def a_unit_test_stays_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``unit`` that starts a child process or binds or connects a socket fails
    (mark it ``process``), so ``pytest -m unit`` stays in-process and fast. Session and module
    fixtures are set up before this one: a shared build (the fake NVML's compiler) is not the
    test's."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    seen: list[str] = []
    patch = pytest.MonkeyPatch()
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def start(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(f"started {str(args)[:100]}")
        return execute_child(self, args, *rest, **kwargs)

    patch.setattr(subprocess.Popen, "_execute_child", start)
    fork = os.fork

    def forked() -> int:
        seen.append("forked")
        return fork()

    patch.setattr(os, "fork", forked)
    for name in ("bind", "connect", "connect_ex"):
        real = getattr(socket.socket, name)

        def use(self, address, real=real, name=name):  # type: ignore[no-untyped-def]
            seen.append(f"called socket.{name}({address!r})")
            return real(self, address)

        patch.setattr(socket.socket, name, use)
    try:
        yield
    finally:
        patch.undo()
    if seen:  # after the test: code under test that swallows errors cannot hide it
        pytest.fail(f"marked unit, but it {seen[0]}: mark it process", pytrace=False)
