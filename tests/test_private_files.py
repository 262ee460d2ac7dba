"""Every file and directory we create is this user's alone (issue 18.13): the processor's
forward queue (every request verbatim) and state (alert history), ``--record``,
``--summary-json`` and a report are created 0600 in 0700 directories whatever the umask, and
another real user cannot read them even in a shared (1777) directory."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import users
from support.cli import clean_env
from support.otlp_receiver import call
from support.ports import free_port
from support.processor import ProcessorProcess
from support.synth import agent_request

from otel_gpu.core.private_files import (
    open_private,
    private_dir,
    private_file,
    tighten_dir,
)
from otel_gpu.processor.wire import METRICS_EXPORT

CLI = [sys.executable, "-m", "otel_gpu.cli"]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    """This process's umask (children inherit it) set to ``value`` for the block."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


# -- the helper -------------------------------------------------------------------------------


@pytest.mark.unit
def test_files_and_directories_are_created_private_whatever_the_umask(tmp_path: Path) -> None:
    with umask(0):
        nested = tmp_path / "a" / "b" / "c"
        private_dir(str(nested))
        with open_private(str(nested / "out.json"), "w", encoding="utf-8") as fh:
            fh.write("{}")
        with open_private(str(nested / "out.json"), "a", encoding="utf-8") as fh:
            fh.write("\n")
        private_file(str(nested / "db.sqlite"))
        plain = tmp_path / "plain"
        plain.write_text("x")  # the control: what the umask alone gives
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", nested)] == [0o700] * 3
    assert mode(nested / "out.json") == 0o600 and (nested / "out.json").read_text() == "{}\n"
    assert mode(nested / "db.sqlite") == 0o600
    assert mode(plain) == 0o666


@pytest.mark.unit
def test_what_the_user_chose_keeps_its_mode_what_is_ours_is_tightened(tmp_path: Path) -> None:
    chosen = tmp_path / "team-summary.json"
    chosen.write_text("old")
    chosen.chmod(0o640)  # an existing output path: the user's choice
    with open_private(str(chosen)) as fh:
        fh.write("new")
    assert mode(chosen) == 0o640 and chosen.read_text() == "new"
    old_db = tmp_path / "old.queue.sqlite"  # our own file, from a looser version
    old_db.write_text("")
    old_db.chmod(0o644)
    private_file(str(old_db))
    private_file(str(tmp_path / "absent-wal"), create=False)
    assert mode(old_db) == 0o600 and not (tmp_path / "absent-wal").exists()


@pytest.mark.unit
def test_only_a_directory_of_our_own_files_is_tightened(tmp_path: Path) -> None:
    ours, mixed, shared = tmp_path / "q1", tmp_path / "q2", tmp_path / "q3"
    for d in (ours, mixed, shared):
        d.mkdir()
        d.chmod(0o755)
        (d / "x.queue.sqlite").write_text("")
    (mixed / "notes.txt").write_text("")
    shared.chmod(0o1777)

    def is_queue(name: str) -> bool:
        return ".queue.sqlite" in name

    for d in (ours, mixed, shared):
        tighten_dir(str(d), is_queue)
    assert (mode(ours), mode(mixed), mode(shared)) == (0o700, 0o755, 0o1777)


# -- real runs, another real user ---------------------------------------------------------------


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    return users.other_user()


def _walk(root: Path) -> tuple[list[Path], list[Path]]:
    dirs, files = [root], []
    for here, names, leaves in os.walk(root):
        dirs += [Path(here, n) for n in names]
        files += [Path(here, n) for n in leaves]
    return dirs, files


def _readable_by(user: pwd.struct_passwd, paths: list[Path]) -> list[str]:
    """The paths ``user`` could read (files) or list (directories)."""
    probe = (
        "import os, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(1)\n"
        "        print(p)\n"
        "    except PermissionError:\n"
        "        pass\n"
    )
    out = users.as_user(user, [users.OTHER_PYTHON, "-c", probe, *map(str, paths)])
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.process
def test_the_processors_queue_and_state_are_private(other_user: pwd.struct_passwd) -> None:
    with users.shared_directory() as shared:
        qdir, state = shared / "spool" / "queue", shared / "state.sqlite"
        down = free_port()  # the downstream is down: every request stays in the queue
        with umask(0):  # the loosest: without the rule, everything would be 0666 / 0777
            proc = ProcessorProcess(
                "--listen", "127.0.0.1:0", "--forward", f"127.0.0.1:{down}",
                "--queue-dir", str(qdir), "--state", str(state), "--flush-timeout", "1",
            )  # fmt: skip
        try:
            for k in range(5):
                request = agent_request(1_700_000_000_000_000_000 + k * 15_000_000_000, gpus=1)
                call(proc.address, METRICS_EXPORT, request.SerializeToString())
        finally:
            proc.terminate()
        dirs, files = _walk(qdir)
        files += [p for p in shared.iterdir() if p.name.startswith("state.sqlite")]
        assert any(p.name.endswith(".queue.sqlite") for p in files), files
        assert state in files and os.path.getsize(next(f for f in files if "queue" in f.name))
        assert {str(d): mode(d) for d in dirs} == {str(d): 0o700 for d in dirs}
        assert {str(f): mode(f) for f in files} == {str(f): 0o600 for f in files}
        assert _readable_by(other_user, [*dirs[1:], *files]) == []
        assert _readable_by(other_user, [shared]) == [str(shared)]  # the probe does read


@pytest.mark.process
def test_run_outputs_and_a_report_are_private(other_user: pwd.struct_passwd) -> None:
    with users.shared_directory() as shared:
        record, summary, report = shared / "run.csv", shared / "s.json", shared / "r.html"
        with umask(0):
            run = subprocess.run(
                [*CLI, "run", "--exporter", "none", "--simulate", "leak", "--interval", "0.2",
                 "--quiet", "--record", str(record), "--summary-json", str(summary),
                 "--", sys.executable, "-c", "import time; time.sleep(1)"],
                capture_output=True, text=True, timeout=90, env=clean_env(),
            )  # fmt: skip
            assert run.returncode == 0, run.stderr[-2000:]
            rep = subprocess.run(
                [*CLI, "report", str(record), "--output", str(report)],
                capture_output=True, text=True, timeout=120, env=clean_env(),
            )  # fmt: skip
            assert rep.returncode == 0, rep.stderr[-2000:]
        assert json.loads(summary.read_text())["exit_code"] == 0
        outputs = [record, summary, report]
        assert [mode(p) for p in outputs] == [0o600] * 3
        assert _readable_by(other_user, outputs) == []
