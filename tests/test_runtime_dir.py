"""The user's private runtime directory (otel_gpu/core/runtime_dir.py): where the node lock and
the control sockets live. Another local user can neither take it over nor make us stop
sampling by creating it first."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import users

from otel_gpu.core import runtime_dir as rd

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]

# A process that takes the node lock and reports where, and what its child would use.
PROBE = (
    "import os, subprocess, sys\n"
    "from otel_gpu.agent.node_lock import acquire_node_lock, lock_directory\n"
    "print(acquire_node_lock(), lock_directory())\n"
    "print(subprocess.run([sys.executable, '-c', 'from otel_gpu.core.runtime_dir import "
    "runtime_dir; print(runtime_dir())'], capture_output=True, text=True).stdout.strip())\n"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (rd.RUNTIME_DIR_ENV, "XDG_RUNTIME_DIR")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _probe(env: dict[str, str]) -> tuple[str, str, str, str]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 0, res.stderr
    (took, lock_dir), (child,) = (line.split() for line in res.stdout.splitlines())
    return took, lock_dir, child, res.stderr


@pytest.fixture
def reset():  # type: ignore[no-untyped-def]
    rd.reset_for_tests()
    yield
    rd.reset_for_tests()


def test_the_default_is_a_0700_directory_of_ours_in_the_temp_dir(tmp_path: Path) -> None:
    took, lock_dir, child, _ = _probe(_clean_env(TMPDIR=str(tmp_path)))
    expected = tmp_path / f"otel-gpu-{os.getuid()}"
    assert (took, lock_dir, child) == ("True", str(expected), str(expected))
    assert stat.S_IMODE(expected.stat().st_mode) == 0o700


def test_xdg_runtime_dir_is_preferred_when_it_is_ours(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    took, lock_dir, _, _ = _probe(_clean_env(TMPDIR=str(tmp_path), XDG_RUNTIME_DIR=str(xdg)))
    assert (took, lock_dir) == ("True", str(xdg / "otel-gpu"))


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o777])
def test_a_runtime_dir_others_can_use_is_refused_with_one_warning(
    tmp_path: Path, mode: int, reset: None, caplog: pytest.LogCaptureFixture
) -> None:
    given = tmp_path / "given"
    given.mkdir()
    given.chmod(mode)
    env = {rd.RUNTIME_DIR_ENV: str(given)}
    with caplog.at_level("WARNING"):
        chosen = rd._resolve(env)  # noqa: SLF001
        rd._resolve(dict(env))  # noqa: SLF001 (the same directory again: no second warning)
    assert chosen != str(given) and rd.private_problem(chosen) is None
    warnings = [r.getMessage() for r in caplog.records if str(given) in r.getMessage()]
    assert len(warnings) == 1 and f"mode {mode:o}" in warnings[0], warnings


def test_a_symlink_is_never_followed(tmp_path: Path, reset: None) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / f"otel-gpu-{os.getuid()}"
    link.symlink_to(target)
    env = {"TMPDIR": str(tmp_path)}
    old = tempfile.tempdir
    tempfile.tempdir = str(tmp_path)
    try:
        chosen = rd._resolve(env)  # noqa: SLF001
    finally:
        tempfile.tempdir = old
    assert chosen not in (str(link), str(target))
    assert env[rd.RUNTIME_DIR_ENV] == chosen  # handed to the children


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    return users.other_user()


def test_another_user_creating_our_directory_first_does_not_stop_our_sampling(
    other_user: pwd.struct_passwd,
) -> None:
    shared = Path(tempfile.mkdtemp(prefix="otel-gpu-test-", dir="/tmp"))
    try:
        shared.chmod(0o1777)  # like /tmp, /scratch
        squatted = shared / f"otel-gpu-{os.getuid()}"
        subprocess.run(
            ["mkdir", "-m", "0777", str(squatted)],
            user=other_user.pw_uid, group=other_user.pw_gid, check=True, cwd="/",
        )  # fmt: skip
        assert squatted.stat().st_uid == other_user.pw_uid
        took, lock_dir, child, stderr = _probe(_clean_env(TMPDIR=str(shared)))
        assert took == "True"  # we still own the node and sample it
        assert lock_dir != str(squatted) and Path(lock_dir).parent == shared
        assert stat.S_IMODE(Path(lock_dir).stat().st_mode) == 0o700
        assert Path(lock_dir).stat().st_uid == os.getuid()
        assert child == lock_dir  # the processes we start share it
        assert f"not using {squatted}" in stderr and "belongs to uid" in stderr
        assert list(squatted.iterdir()) == []  # nothing of ours landed in theirs
    finally:
        shutil.rmtree(shared, ignore_errors=True)
