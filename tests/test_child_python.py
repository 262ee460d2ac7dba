"""Every Python interpreter we start keeps the working directory off ``sys.path`` (issue 18.2):
one helper builds their argv (otel_gpu/core/child_python.py), no module bypasses it, and a
``json.py`` (or ``otel_gpu/``, ``sitecustomize.py``, ...) another real user leaves in a shared
directory never runs when root launches ``otel-gpu run`` there."""

from __future__ import annotations

import ast
import json
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from support import users
from support.tiny_training import offline_env

from otel_gpu.core import child_python

PACKAGE = Path(__file__).resolve().parents[1] / "otel_gpu"
HELPER = PACKAGE / "core" / "child_python.py"
# The installed console script, as users run it (a script: its own directory is sys.path[0]).
OTEL_GPU = str(Path(sys.executable).with_name("otel-gpu"))

# Names a child of ours imports (or the interpreter looks for) after start-up.
PLANTED = (
    "json.py", "pickle.py", "struct.py", "select.py", "runpy.py", "dataclasses.py",
    "pynvml.py", "sitecustomize.py", "usercustomize.py", "site.py", "otel_gpu/__init__.py",
)  # fmt: skip


def executable_uses(source: str, filename: str = "<src>") -> list[int]:
    """Lines naming ``sys.executable`` (or importing ``executable`` from ``sys``)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        attribute = isinstance(node, ast.Attribute) and node.attr == "executable"
        if attribute and isinstance(node.value, ast.Name) and node.value.id == "sys":  # type: ignore[attr-defined]
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            lines += [node.lineno for alias in node.names if alias.name == "executable"]
    return lines


@pytest.mark.unit
def test_the_check_sees_both_spellings() -> None:
    assert executable_uses("import sys\nsubprocess.run([sys.executable, '-c', 'x'])\n") == [2]
    assert executable_uses("from sys import executable as e\n") == [1]
    assert executable_uses("import sys\nsys.argv\nexecutable = 1\n") == []


@pytest.mark.unit
def test_no_module_starts_an_interpreter_without_the_helper() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HELPER
        for line in executable_uses(path.read_text(), str(path))
    ]
    assert not found, (
        "start child interpreters with otel_gpu.core.child_python.python_argv (it keeps the "
        "working directory off sys.path):\n" + "\n".join(found)
    )


def _plant(where: Path, marker: Path) -> None:
    for name in PLANTED:
        (where / name).parent.mkdir(exist_ok=True)
        (where / name).write_text(_planted_code(marker))


@pytest.mark.process
@pytest.mark.parametrize("form", ["-m", "-c"])
@pytest.mark.parametrize("flag", [True, False], ids=["dash-P", "bootstrap"])
def test_a_module_in_the_working_directory_is_not_imported(
    tmp_path: Path, form: str, flag: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both ways: -P (3.11+) and the bootstrap older interpreters get.
    if flag and not child_python.SAFE_PATH_FLAG:
        pytest.skip("-P needs Python 3.11")
    monkeypatch.setattr(child_python, "SAFE_PATH_FLAG", flag)
    marker = tmp_path / "RAN"
    _plant(tmp_path, marker)
    program = (
        ("-m", "json.tool", "--compact", "x.json")
        if form == "-m"
        else ("-c", "import json, sys; print(json.dumps(sys.argv[1:]))", "a", "b")
    )
    (tmp_path / "x.json").write_text('{"a": [1, 2]}')
    argv = child_python.python_argv(*program)
    assert ("-P" in argv) is flag
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ('{"a":[1,2]}' if form == "-m" else '["a", "b"]')
    assert not marker.exists(), marker.read_text()


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    return users.other_user()


@pytest.mark.process
def test_modules_another_user_leaves_where_root_runs_the_job_never_run(
    other_user: pwd.struct_passwd, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    job = tmp_path / "train.py"  # python /path/train.py: its own directory, not the cwd
    job.write_text("import json, time\ntime.sleep(2)\nprint(json.dumps({'ok': 1}))\n")
    summary = tmp_path / "summary.json"
    with users.shared_directory() as shared:
        marker = shared / "RAN"
        planter = users.as_user(
            other_user,
            [users.OTHER_PYTHON, "-c", "import sys; exec(sys.stdin.read())"],
            input=(
                "import pathlib\n"
                f"shared = pathlib.Path({str(shared)!r})\n"
                f"code = {_planted_code(marker)!r}\n"
                f"for name in {PLANTED!r}:\n"
                "    (shared / name).parent.mkdir(exist_ok=True)\n"
                "    (shared / name).write_text(code)\n"
            ),
        )
        assert planter.returncode == 0, planter.stderr
        assert (shared / "json.py").stat().st_uid == other_user.pw_uid
        proc = subprocess.run(
            [OTEL_GPU, "run", "--exporter", "none", "--interval", "0.2", "--summary-json",
             str(summary), "--", sys.executable, str(job)],
            cwd=shared, capture_output=True, text=True, timeout=90,
            env=fake_nvml.env(offline_env(CUDA_VISIBLE_DEVICES="0", OTEL_GPU_LOCK_DIR=str(tmp_path))),
        )  # fmt: skip
        ran = marker.read_text() if marker.exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '{"ok": 1}' in proc.stdout
    assert ran == "", f"planted code ran as root:\n{ran}"
    data = json.loads(summary.read_text())
    assert data["gpus"], data  # the sampling helper did run and read the GPU


def _planted_code(marker: Path) -> str:
    return (
        "import sys\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write(__name__ + ' ' + repr(sys.argv) + '\\n')\n"
    )
