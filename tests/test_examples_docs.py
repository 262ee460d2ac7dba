"""Each example's README lists what the example needs before it runs."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer"
# transformers' Trainer refuses to start without accelerate, which train.py never imports.
TRAINER_NEEDS = {"accelerate"}


def test_the_hf_trainer_readme_lists_every_prerequisite() -> None:
    tree = ast.parse((EXAMPLE / "train.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0] for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }  # fmt: skip
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "__future__"}
    assert third_party == {"torch", "transformers"}  # if this changes, so must the README
    readme = (EXAMPLE / "README.md").read_text()
    install = next(line for line in readme.splitlines() if line.startswith("pip install"))
    named = {re.split(r"[=<>!~\[]", word)[0] for word in install.split()}
    assert third_party | TRAINER_NEEDS <= named, install
