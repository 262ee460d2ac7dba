"""The control channel between otel-gpu and the in-process part (otel_gpu/core/channel.py):
one JSON request, one JSON reply, over a Unix socket only this user can use, bounded in size
and time, served off the job's threads; and the real in-process part answering it."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from otel_gpu.core import channel
from otel_gpu.core.channel import ChannelError, ControlServer, request, socket_path

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"  # an interpreter another user can run (the venv's may not be)
OTHER_USER = "otelgpu-tenant"


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def server(private_dir: Path):  # type: ignore[no-untyped-def]
    calls: list[str] = []

    def echo(req):  # type: ignore[no-untyped-def]
        calls.append(threading.current_thread().name)
        return {"echo": req.get("value")}

    def boom(_req):  # type: ignore[no-untyped-def]
        raise RuntimeError("the handler broke")

    def big(req):  # type: ignore[no-untyped-def]
        return {"blob": "x" * int(req["n"])}

    def odd(_req):  # type: ignore[no-untyped-def]
        return {"by_pair": {(1, 2): 3}}  # JSON has no tuple keys

    srv = ControlServer(
        socket_path(str(private_dir), os.getpid()),
        {"echo": echo, "boom": boom, "big": big, "odd": odd},
    )
    srv.calls = calls  # type: ignore[attr-defined]
    yield srv
    srv.close()


def test_a_request_gets_its_handlers_reply_on_a_channel_thread(server: ControlServer) -> None:
    assert request(server.path, "echo", value=[1, "two"]) == {"echo": [1, "two"]}
    assert server.calls == ["otel-gpu-control-request"]  # type: ignore[attr-defined]


def test_unknown_ops_and_broken_handlers_answer_one_line_and_the_server_goes_on(
    server: ControlServer,
) -> None:
    with pytest.raises(
        ChannelError, match=r"^unknown op 'nope': this process serves big, boom, echo, odd$"
    ):
        request(server.path, "nope")
    with pytest.raises(ChannelError, match=r"^boom failed: RuntimeError: the handler broke$"):
        request(server.path, "boom")
    with pytest.raises(ChannelError, match=r"^the reply could not be encoded: keys must be"):
        request(server.path, "odd")  # an answer, not a connection closed without one
    assert request(server.path, "echo", value=1) == {"echo": 1}


def test_garbage_and_oversized_requests_are_refused(server: ControlServer) -> None:
    for payload in (b"not json\n", b"[1, 2]\n", b"{" + b" " * (channel.MAX_REQUEST + 10) + b"}\n"):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(server.path)
            with contextlib.suppress(BrokenPipeError):
                s.sendall(payload)
            reply = json.loads(s.makefile().readline())
        assert reply["error"].startswith("bad request"), reply
    with pytest.raises(ChannelError, match="over the limit"):
        request(server.path, "big", n=channel.MAX_REPLY + 1)


def test_the_socket_is_this_users_only(server: ControlServer, private_dir: Path) -> None:
    mode = os.stat(server.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(private_dir.stat().st_mode) == 0o700


def test_a_trickling_client_is_dropped_at_the_request_deadline_and_others_are_served(
    server: ControlServer,
) -> None:
    tricklers = []
    for _ in range(channel.MAX_CONCURRENT):
        s = socket.socket(socket.AF_UNIX)
        s.connect(server.path)
        tricklers.append(s)
    started = time.monotonic()

    def trickle(s: socket.socket) -> float:
        try:
            while time.monotonic() - started < 10:
                s.sendall(b" ")
                time.sleep(0.3)
        except OSError:
            pass
        return time.monotonic() - started

    results: list[float] = []
    threads = [threading.Thread(target=lambda s=s: results.append(trickle(s))) for s in tricklers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    for s in tricklers:
        s.close()
    # each was answered "bad request: timed out" and closed at the deadline, not after 10 s
    assert len(results) == channel.MAX_CONCURRENT
    assert all(r < channel.REQUEST_DEADLINE_S + 2.0 for r in results), results
    assert request(server.path, "echo", value="after") == {"echo": "after"}


def test_a_forked_child_neither_serves_nor_removes_the_socket(server: ControlServer) -> None:
    pid = os.fork()
    if pid == 0:  # the child: exits through atexit handlers like a DataLoader worker would
        code = 0 if server._closed.is_set() else 3  # noqa: SLF001
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(server.path)
    assert request(server.path, "echo", value="still") == {"echo": "still"}


def test_close_removes_the_socket_and_clients_say_why(private_dir: Path) -> None:
    srv = ControlServer(socket_path(str(private_dir), os.getpid()), {})
    srv.close()
    assert not os.path.exists(srv.path)
    with pytest.raises(ChannelError, match="^no in-process part serves there$"):
        request(srv.path, "hello")


# -- another local user -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    """A second, unprivileged local user (created once; the suite runs as root in CI)."""
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


CONNECT = textwrap.dedent(
    """
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(sys.argv[1])
    except OSError as e:
        print("connect:", type(e).__name__); sys.exit(0)
    try:
        s.sendall(json.dumps({"op": "echo", "value": "stolen"}).encode() + b"\\n")
        data = s.recv(65536)
    except OSError:
        data = b""  # reset: closed without a word
    print("reply:", data.decode() or "<closed>")
    """
)


@pytest.fixture
def shared_dir():  # type: ignore[no-untyped-def]
    """A directory every user can reach (pytest's own temp root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="otel-gpu-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_another_user_gets_no_answer_even_through_open_permissions(
    shared_dir: Path, other_user: pwd.struct_passwd
) -> None:
    tmp_path = shared_dir
    # Layer 1: the socket is 0600 in a 0700 directory: the other user cannot even connect.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    srv = ControlServer(
        socket_path(str(private), os.getpid()), {"echo": lambda r: {"echo": r["value"]}}
    )
    # Layer 2: made reachable on purpose (a leaked path, a bind mount): the server still checks
    # the peer's uid and closes without a word.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    exposed = ControlServer(
        socket_path(str(open_dir), os.getpid()), {"echo": lambda r: {"echo": r["value"]}}
    )
    os.chmod(exposed.path, 0o666)
    try:
        out = {}
        for name, path in (("private", srv.path), ("exposed", exposed.path)):
            res = subprocess.run(
                [SYSTEM_PYTHON, "-I", "-c", CONNECT, path],
                user=other_user.pw_uid, group=other_user.pw_gid, capture_output=True, text=True,
                timeout=30, cwd="/",
            )  # fmt: skip
            out[name] = res.stdout.strip()
        assert out == {"private": "connect: PermissionError", "exposed": "reply: <closed>"}, out
        assert request(exposed.path, "echo", value="mine") == {"echo": "mine"}  # we still can
    finally:
        srv.close()
        exposed.close()


# -- the real in-process part ----------------------------------------------------------------

TRAINER = textwrap.dedent(
    """
    import sys, time
    import otel_gpu
    for n in range(1, 6):
        with otel_gpu.phase("train"):
            otel_gpu.step(n, loss=1.0 / n)
    print("ready", flush=True)
    sys.stdin.readline()  # wait until the test has asked
    """
)


def test_an_instrumented_process_serves_hello_and_every_step_end(private_dir: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OTEL_GPU_RUNTIME_DIR": str(private_dir),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_GPU_DETECT": "false",
        "OTEL_GPU_ROLE": "trainer",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
    }
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument"), sys.executable,
         "-c", TRAINER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        path = socket_path(str(private_dir), proc.pid)
        hello = request(path, "hello")
        assert hello["pid"] == proc.pid
        assert (hello["rank"], hello["local_rank"], hello["world_size"]) == (3, 1, 4)
        assert {"hello", "progress"} <= set(hello["ops"])
        first = request(path, "progress", since=0)
        assert [s[1] for s in first["steps"]] == [1, 2, 3, 4, 5] and first["step"] == 5
        times = [s[2] for s in first["steps"]]
        assert times == sorted(times) and abs(times[-1] - time.time()) < 60
        again = request(path, "progress", since=first["seq"])
        assert again["steps"] == [] and again["seq"] == first["seq"]
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(socket_path(str(private_dir), proc.pid))  # removed at exit
