"""The suite's own rules: test modules share code through tests/support/, never import each
other, and every test carries exactly one tier (tests/support/tiers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.tiers import UNTIERED

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def test_no_test_module_imports_another_and_support_imports_none() -> None:
    test_modules = {p.stem for p in TESTS.glob("test_*.py")}
    found = [
        f"{path.relative_to(TESTS)}:{line}: imports {module}"
        for path in sorted([*TESTS.glob("*.py"), *(TESTS / "support").glob("*.py")])
        for line, module in imported_modules(path)
        if module.split(".")[0] in test_modules
    ]
    assert not found, "move what they share into tests/support/:\n" + "\n".join(found)


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    untiered = request.config.stash[UNTIERED]
    assert not untiered, (
        "give each test one of unit, process, peers (pytestmark = pytest.mark.<tier>):\n"
        + "\n".join(untiered[:50])
    )
