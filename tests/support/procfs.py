"""Fake /proc folders made of real files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

BLOCKED_PID = 4190001


def blocking_proc_root(tmp_path: Path) -> Path:
    """A /proc whose process entry 4190001 has a FIFO for ``stat``: opening it blocks forever
    (nobody writes), as a read of a process stuck in the kernel does."""
    root = tmp_path / "proc"
    (root / str(BLOCKED_PID)).mkdir(parents=True)
    os.mkfifo(root / str(BLOCKED_PID) / "stat")
    for name in ("stat", "uptime", "self"):
        (root / name).symlink_to(f"/proc/{name}")
    return root


BTIME = 1_700_000_000


class FakeProc:
    """A /proc folder made of real files, as the kernel lays it out (the parts we read)."""

    def __init__(self, root: Path, *, host_namespace: bool = True) -> None:
        self.root = root
        root.mkdir(exist_ok=True)
        (root / "stat").write_text(f"cpu  1 2 3 4\nbtime {BTIME}\nprocesses 9\n")
        if host_namespace:  # kernel threads are only visible from the initial PID namespace
            self.add(2, comm="kthreadd", ppid=0, cmdline=(), exe=None)

    def add(
        self,
        pid: int,
        *,
        ppid: int = 1,
        comm: str = "python3",
        state: str = "S",
        utime: int = 0,
        stime: int = 0,
        threads: int = 1,
        starttime: int = 1000,
        vsize: int = 10 << 20,
        rss_pages: int = 256,
        nspid: Sequence[int] | None = None,
        uid: int = 0,
        cmdline: Sequence[str] = ("python3", "train.py"),
        exe: str | None = "/usr/bin/python3.11",
        fds: Sequence[str] = ("/dev/null", "pipe:[1]"),
    ) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        rest = ["0"] * 49
        rest[0], rest[1] = state, str(ppid)
        rest[11], rest[12], rest[17] = str(utime), str(stime), str(threads)
        rest[19], rest[20], rest[21] = str(starttime), str(vsize), str(rss_pages)
        (d / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
        ns = "\t".join(map(str, nspid or (pid,)))
        (d / "status").write_text(
            f"Name:\t{comm}\nState:\t{state}\nPid:\t{pid}\nPPid:\t{ppid}\n"
            f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nNSpid:\t{ns}\nThreads:\t{threads}\n"
        )
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in cmdline))
        if (d / "exe").is_symlink():
            (d / "exe").unlink()
        if exe:
            (d / "exe").symlink_to(exe)  # dangling is fine: only readlink() is used
        fd_dir = d / "fd"
        fd_dir.mkdir(exist_ok=True)
        for old in fd_dir.iterdir():
            old.unlink()
        for i, target in enumerate(fds):
            (fd_dir / str(i)).symlink_to(target)

    def remove(self, pid: int) -> None:
        d = self.root / str(pid)
        for p in sorted(d.rglob("*"), key=lambda p: -len(p.parts)):
            p.unlink() if p.is_symlink() or p.is_file() else p.rmdir()
        d.rmdir()
