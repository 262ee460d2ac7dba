"""`otel-gpu diagnose memory` against real torch (CPU) training loops (issue 20 §2-§3): six
planted leak shapes are each named by their holder; four benign shapes name none; a process
without the in-process part gets one line and exit 2; another local user gets no census."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.leak_trainer import LEAK_HOLDERS, ROOT, running_trainer

from otel_gpu.core.channel import socket_path

pytestmark = pytest.mark.peers  # each trainer imports torch and trains for seconds

SYSTEM_PYTHON = "/usr/bin/python3"
OTHER_USER = "otelgpu-tenant"


def diagnose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_gpu.cli", "diagnose", "memory", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def runtime_dir() -> Iterator[Path]:
    # Under a 0755 directory another user can reach, itself 0700 (the runtime directory rule).
    base = Path(tempfile.mkdtemp(prefix="otel-gpu-test-", dir="/tmp"))
    base.chmod(0o755)
    run = base / "run"
    run.mkdir(mode=0o700)
    yield run
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def leaking(runtime_dir: Path) -> Iterator[tuple[int, dict[str, Any], str]]:
    """(pid, the --json answer, the table) of the trainer with the six planted leaks."""
    with running_trainer("leaks", runtime_dir) as proc:
        res = diagnose("--pid", str(proc.pid), "--over", "2", "--top", "30", "--json")
        assert res.returncode == 0, res.stderr
        table = diagnose("--pid", str(proc.pid), "--over", "1")
        assert table.returncode == 0, table.stderr
        yield proc.pid, json.loads(res.stdout), table.stdout


@pytest.mark.parametrize("shape", sorted(LEAK_HOLDERS))
def test_each_planted_leak_is_named_by_its_holder(
    shape: str, leaking: tuple[int, dict[str, Any], str]
) -> None:
    pid, answer, _table = leaking
    assert answer["pid"] == pid
    holders = {h["path"]: h for h in answer["holders"]}
    path = LEAK_HOLDERS[shape]
    assert path in answer["growing"], (shape, answer["growing"])
    h = holders[path]
    assert h["growth_count"] > 0 and h["growth_bytes"] > 0 and h["count"] >= h["growth_count"]
    assert h["dtypes"] == {"float32": h["count"]} and set(h["devices"]) == {"cpu"}
    if path == "losses":  # a frame local: its function and file, and graphs kept alive
        assert h["root"] == "local" and h["site"].startswith("train() at train.py:"), h
        assert h["grad_fn"] == h["count"]
    elif path.startswith("leakylib."):
        assert (h["root"], h["site"]) == ("global", "leakylib.py")
    else:
        assert (h["root"], h["site"]) == ("global", "train.py")


def test_only_the_planted_leaks_grow_and_the_table_names_them(
    leaking: tuple[int, dict[str, Any], str],
) -> None:
    _pid, answer, table = leaking
    assert set(answer["growing"]) == set(LEAK_HOLDERS.values())
    assert len(answer["censuses"]) == 3 and answer["over_s"] >= 2.0
    assert all(c["truncated"] is None for c in answer["censuses"])
    for path in LEAK_HOLDERS.values():
        assert f"GROWING {path}  [" in table, table
    assert "no holder grew" not in table


def test_benign_shapes_name_no_growing_holder(runtime_dir: Path) -> None:
    with running_trainer("benign", runtime_dir) as proc:
        res = diagnose("--pid", str(proc.pid), "--over", "2", "--top", "50", "--json")
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    assert answer["growing"] == [], answer["holders"]
    paths = {h["path"] for h in answer["holders"]}
    # the benign shapes are there, named, and hold memory; they just do not grow
    assert {"train.replay", "train.recent", "train.opt.state"} <= paths, paths
    replay = next(h for h in answer["holders"] if h["path"] == "train.replay")
    assert replay["count"] == 32 and replay["growth_count"] == 0


def test_a_process_without_the_in_process_part_gets_one_line_and_exit_2(tmp_path: Path) -> None:
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        res = diagnose("--pid", str(plain.pid), "--over", "0")
    finally:
        plain.kill()
        plain.wait()
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"otel-gpu: error: pid {plain.pid}: no in-process part serves")
    assert "otel-gpu run -- python" in lines[0]
    gone = diagnose("--pid", str(plain.pid), "--over", "0")
    assert gone.returncode == 2 and f"pid {plain.pid}: no such process" in gone.stderr


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True, capture_output=True,
        )  # fmt: skip
        return pwd.getpwnam(OTHER_USER)


ASK = textwrap.dedent(
    """
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    try:
        s.connect(sys.argv[1])
    except OSError as e:
        print("connect:", type(e).__name__); sys.exit(0)
    try:
        s.sendall(json.dumps({"op": "memory.census", "over_s": 0}).encode() + b"\\n")
        data = s.recv(65536)
    except OSError:
        data = b""
    print("reply:", data.decode()[:40] or "<closed>")
    """
)


def test_another_user_gets_no_census(runtime_dir: Path, other_user: pwd.struct_passwd) -> None:
    with running_trainer("benign", runtime_dir) as proc:
        path = socket_path(str(runtime_dir), proc.pid)

        def ask() -> str:
            return subprocess.run(
                [SYSTEM_PYTHON, "-I", "-c", ASK, path], user=other_user.pw_uid,
                group=other_user.pw_gid, capture_output=True, text=True, timeout=60, cwd="/",
            ).stdout.strip()  # fmt: skip

        private = ask()
        runtime_dir.chmod(0o755)  # opened on purpose: the peer's uid is still checked
        os.chmod(path, 0o666)
        try:
            exposed = ask()
            mine = diagnose("--pid", str(proc.pid), "--over", "0", "--json")
        finally:
            runtime_dir.chmod(0o700)
    assert (private, exposed) == ("connect: PermissionError", "reply: <closed>")
    assert mine.returncode == 0 and json.loads(mine.stdout)["holders"], mine.stderr
