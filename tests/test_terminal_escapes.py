"""Escape sequences in names never reach a terminal (issue 18, item 14): a real program whose
file name holds OSC / CSI / SGR sequences, a (fake) driver whose GPU name holds them (a UUID
that does is not watched at all: tests/test_odd_values.py), and the live view, the plain view,
the summary, log lines, ``doctor`` and chat notifications that show them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from support.tiny_training import offline_env

from otel_gpu.actions import ActionDispatcher, SlackNotifier
from otel_gpu.core.printable import printable
from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.model import LEAK, Alert

pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "otel_gpu.cli"]
# A window title (OSC 0, BEL-terminated), a screen clear and a colour: 15 bytes of a name.
HOSTILE = "\x1b]0;pwn\x07\x1b[2J\x1b[31mevil"
SEQUENCES = ("\x1b]0;", "\x07", "\x1b[2J", "\x1b[31m", "\x9b")


def _clean(text: str, ours: bool = False) -> None:
    """No hostile sequence in ``text``; ``ours``: the live view draws with its own CSI and
    SGR sequences (never OSC, BEL or a screen clear), so only the name's must be gone."""
    for seq in SEQUENCES if not ours else ("\x1b]0;", "\x07", "\x1b[2J", "\x9b", "[31mevil"):
        assert seq not in text, f"{seq!r} reached the terminal"


@pytest.fixture
def hostile_program(tmp_path: Path) -> Path:
    """A copy of ``sleep`` whose file name is :data:`HOSTILE` (what /proc/PID/exe shows)."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    path = tmp_path / HOSTILE
    shutil.copy(sleep, path)
    return path


@pytest.mark.parametrize("view", [[], ["--view"]], ids=["plain", "live"])
def test_a_hostile_process_name_is_printed_stripped(
    hostile_program: Path, tmp_path: Path, view: list[str]
) -> None:
    res = subprocess.run(
        [*CLI, "run", *view, "--simulate", "steady", "--exporter", "none", "--interval", "0.2",
         "--", str(hostile_program), "2"],
        capture_output=True, text=True, timeout=60, env=offline_env(OTEL_GPU_LOCK_DIR=str(tmp_path)),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    _clean(res.stderr, ours=bool(view))
    # The name is still shown, without its sequences (the OSC's title "pwn" went with it).
    assert "watching evil (PID" in res.stderr and "pwn" not in res.stderr
    summary = res.stderr[res.stderr.index("otel-gpu summary") :]
    assert "evil " in summary  # the summary's process row


def test_a_hostile_gpu_name_is_printed_stripped(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    # \xNN escapes in the fake's scenario: the driver reports these bytes.
    fake_nvml.write(
        """
        devices = 1
        gpu.0.name = \\x1b]0;pwn\\x07\\x1b[2JNVIDIA H100
        gpu.0.uuid = GPU-00001111-2222-3333-4444-555566667777
        gpu.0.memory.total = 85899345920
        gpu.0.memory.used = 1073741824
        """
    )
    env = fake_nvml.env(offline_env(OTEL_GPU_LOCK_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="0"))
    doctor = subprocess.run(
        [*CLI, "doctor", "--endpoint", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    _clean(doctor.stdout + doctor.stderr)
    assert "NVIDIA H100 GPU-00001111-2222" in doctor.stdout and "pwn" not in doctor.stdout
    run = subprocess.run(
        [*CLI, "run", "-v", "--exporter", "none", "--interval", "0.2", "--", "sleep", "1.5"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    _clean(run.stderr)
    assert "GPU0" in run.stderr and "H100" in run.stderr and "pwn" not in run.stderr


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        return


def test_a_chat_notification_carries_no_escape_sequence() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Receiver.bodies = []
    subject = f"process:4242@GPU-{HOSTILE}"
    alert = Alert(LEAK, subject, 10.0, "critical", f"memory grows in {HOSTILE}")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/slack"
        dispatcher = ActionDispatcher([SlackNotifier(url)], span_events=False)
        dispatcher.on_transition(Transition(subject, "closed", "open", 10.0, "x", alert, 1))
        assert dispatcher.flush(10)
        dispatcher.close(2)
    finally:
        server.shutdown()
        server.server_close()
    (body,) = _Receiver.bodies
    text = json.dumps(json.loads(body), ensure_ascii=False)  # what the chat client shows
    _clean(text)
    assert "GPU-evil" in text and "grows in evil" in text


@pytest.mark.parametrize(
    ("raw", "line", "multiline"),
    [
        ("\x1b[31mred\x1b[0m", "red", "red"),
        ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link", "link"),  # OSC 8 hyperlink
        ("a\x9b2Jb\x1bcc", "abc", "abc"),  # 8-bit CSI, ESC c (reset)
        ("two\nlines\ttab\r\x08", "two lines tab", "two\nlines\ttab"),
        ("abc\u202edcba", "abcdcba", "abcdcba"),  # a bidi override
        ("cut \x1b]0;title", "cut ", "cut "),  # a sequence cut short
        ("café 80GB", "café 80GB", "café 80GB"),
    ],
)
def test_printable(raw: str, line: str, multiline: str) -> None:
    assert printable(raw) == line
    assert printable(raw, multiline=True) == multiline
