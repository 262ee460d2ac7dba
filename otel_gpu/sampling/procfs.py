"""Readers for the few ``/proc`` files the process tree needs.

Plain functions of ``(proc_root, pid)``: no state, no psutil. Each returns ``None`` (or an empty
value) when the process is gone or the file is unreadable; callers decide what that means.
"""

from __future__ import annotations

import contextlib
import os

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ProcStat:
    """One ``/proc/PID/stat`` line. The tree reads one per visible process, so only what the
    parent map needs is parsed up front; the rest is parsed for tracked processes only."""

    __slots__ = ("state", "ppid", "starttime", "_rest", "_comm")

    def __init__(self, data: bytes) -> None:
        # comm is in parentheses and may contain spaces and ")": split after the last ")".
        close = data.rfind(b")")
        rest = data[close + 2 :].split(None, 20)
        if close < 0 or len(rest) < 21:
            raise ValueError("truncated stat line")
        self.state = rest[0].decode("ascii", "replace")
        self.ppid = int(rest[1])
        self.starttime = int(rest[19])  # ticks after boot: with the PID, a process's identity
        self._rest = rest
        self._comm = data[data.find(b"(") + 1 : close]

    @property
    def comm(self) -> str:
        return self._comm.decode("utf-8", "replace")

    @property
    def comm_raw(self) -> bytes:
        """comm as the kernel wrote it (comparing bytes needs no decoding)."""
        return self._comm

    def usage(self) -> tuple[int, int, int, int, int]:
        """(utime + stime ticks, stime ticks, threads, virtual By, resident pages), parsed in
        one go."""
        rest = self._rest
        tail = rest[20].split(None, 2)
        system = int(rest[12])
        return int(rest[11]) + system, system, int(rest[17]), int(tail[0]), int(tail[1])


def parse_stat(data: bytes) -> ProcStat | None:
    """Parse a ``/proc/PID/stat`` line; ``None`` when it is malformed or truncated."""
    try:
        return ProcStat(data)
    except (ValueError, IndexError):
        return None


def read_stat(proc_root: str, pid: int) -> ProcStat | None:
    """``/proc/PID/stat``, or None when the process is gone."""
    # os.open/os.read: about half the cost of open() for these tiny files.
    try:
        fd = os.open(f"{proc_root}/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:  # ESRCH: exited between open and read
        return None
    finally:
        os.close(fd)
    return parse_stat(data)


def read_status(proc_root: str, pid: int) -> tuple[int | None, tuple[int, ...]]:
    """(real uid, ``NSpid:`` levels outermost first) from ``/proc/PID/status``.

    Unknown parts are None / () (a gone process; kernels before 4.1 have no ``NSpid:``).
    """
    uid: int | None = None
    ns: tuple[int, ...] = ()
    path = f"{proc_root}/{pid}/status"
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open(path, encoding="utf-8", errors="replace") as f,
    ):
        for line in f:
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
            elif line.startswith("NSpid:"):
                ns = tuple(int(x) for x in line.split()[1:])
                break
    return uid, ns


def read_cmdline(proc_root: str, pid: int, limit: int) -> list[str] | None:
    """Arguments from ``/proc/PID/cmdline`` (at most ``limit`` bytes read); None if gone.

    Zombies and kernel threads have an empty command line.
    """
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
            raw = f.read(limit)
    except PermissionError:
        return []
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def read_boot_time(proc_root: str) -> float | None:
    """Boot time (s since epoch) from the ``btime`` line of ``/proc/stat``."""
    path = f"{proc_root}/stat"
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open(path, encoding="ascii", errors="replace") as f,
    ):
        for line in f:
            if line.startswith("btime"):
                return float(line.split()[1])
    return None
