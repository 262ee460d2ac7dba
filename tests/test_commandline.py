"""One reading of ``python [options] ...`` (otel_gpu/core/commandline.py), the table its three
users (default service name, process.command, the distro's role) rely on."""

from __future__ import annotations

import pytest

from otel_gpu.core.commandline import python_target

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train.py", "--lr", "1"], ("script", "train.py", 1)),
        (["-u", "train.py"], ("script", "train.py", 2)),
        (["-W", "ignore", "-X", "dev", "train.py"], ("script", "train.py", 5)),
        (["-Wignore", "train.py"], ("script", "train.py", 2)),
        (["-m", "swift.cli.sft", "--model", "m"], ("module", "swift.cli.sft", 2)),
        (["-mtorch.distributed.run"], ("module", "torch.distributed.run", 1)),
        (["-uc", "print(1)", "x"], ("code", "print(1)", 2)),
        (
            ["-c", "import os; os.environ['TOKEN']='x'"],
            ("code", "import os; os.environ['TOKEN']='x'", 2),
        ),
        (["--check-hash-based-pycs", "always", "t.py"], ("script", "t.py", 3)),
        (["--version"], ("stdin", "", 1)),
        (["-"], ("stdin", "", 0)),
        ([], ("stdin", "", 0)),
    ],
)
def test_what_python_runs(args: list[str], expected: tuple[str, str, int]) -> None:
    assert tuple(python_target(args)) == expected
