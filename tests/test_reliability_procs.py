"""docs/reliability.md case 25: huge or binary command lines. Reading ``/proc/PID/cmdline`` is
bounded in bytes (a read never waits for the end of an endless file) and odd bytes never break
a sweep or smuggle a secret past redaction."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from support.procfs import FakeProc

from otel_gpu.sampling.procs import ProcessTree

pytestmark = pytest.mark.unit

CASES = [
    # (case, raw /proc/PID/cmdline, exported process.command_line)
    ("not UTF-8", b"python3\0\xff\xfe.py\0", "python3 \ufffd\ufffd.py"),
    ("a secret after invalid bytes", b"train\xff\0--hf_token\0hf_Secret\0", "train\ufffd --hf_token ***"),
    ("4 MiB of one argument", b"python3\0" + b"A" * (4 << 20) + b"\0", "python3 " + "A" * 248),
    ("no NUL at the end", b"python3\0train.py", "python3 train.py"),
    ("only NULs", b"\0\0\0", None),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "command"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_odd_command_lines(tmp_path: Path, raw: bytes, command: str | None) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100)
    (proc.root / "100" / "cmdline").write_bytes(raw)
    (sample,) = ProcessTree([100], proc_root=str(proc.root), command_max_len=256).sample().processes
    assert sample.command == command
    assert command is None or len(sample.command) <= 256


def test_an_endless_command_line_is_read_only_up_to_the_bound(tmp_path: Path) -> None:
    """A cmdline that never ends (a FIFO whose writer keeps it open after 64 KiB): a bounded
    read returns; a read to the end of the file would wait forever."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100)
    fifo = proc.root / "100" / "cmdline"
    fifo.unlink()
    os.mkfifo(fifo)
    stop = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_WRONLY)
        try:
            os.write(fd, b"python3\0" + b"x" * 65_000)  # fits in the pipe buffer
            stop.wait(30)  # open, never closed: no end of file
        finally:
            os.close(fd)

    threading.Thread(target=writer, daemon=True).start()
    result: list = []
    sampling = threading.Thread(
        target=lambda: result.append(ProcessTree([100], proc_root=str(proc.root)).sample()),
        daemon=True,
    )
    sampling.start()
    sampling.join(20)  # generous: it takes milliseconds, unbounded it never returns
    stop.set()
    assert not sampling.is_alive(), "the cmdline read waited for an end of file"
    (sample,) = result[0].processes
    assert sample.command.startswith("python3 xxx")
