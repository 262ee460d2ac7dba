"""Xids from the kernel log: a bounded, non-blocking reader of ``/dev/kmsg``.

NVML's events never carry some Xids (79, 119, 120, per DCGM's maintainers) that the driver
writes to the kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, ...``). The reader opens the log
non-blocking, starts at its end (old records are not this run's news), and each :meth:`poll`
reads at most ``max_bytes`` and ``max_records``: a flood of kernel messages costs one sweep a
bounded slice, the rest waits for the next. A record longer than ``max_line`` is dropped whole;
bytes that are not UTF-8 are replaced. ``/dev/kmsg`` returns one record per ``read``; a FIFO or
a file (tests) returns arbitrary chunks, so lines are split here either way.

Opening it needs CAP_SYSLOG or ``kernel.dmesg_restrict=0``; without, the reader says so once
and stays off. Never raises.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

from otel_gpu.core.xid import KernelXid, parse_kernel_line

log = logging.getLogger("otel_gpu.sampler.kmsg")

DEFAULT_PATH = "/dev/kmsg"


class KernelLog:
    """``poll()`` -> the Xids the kernel logged since the previous call."""

    def __init__(
        self,
        path: str = DEFAULT_PATH,
        *,
        max_bytes: int = 256 * 1024,
        max_records: int = 2048,
        max_line: int = 8192,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_records = max_records
        self.max_line = max_line
        self._fd: int | None = None
        self._buf = b""
        self._skipping = False  # inside an over-long record: drop until its newline
        self._off_reason: str | None = None
        self.dropped_lines = 0  # over-long records dropped
        self._open()

    @property
    def off_reason(self) -> str | None:
        """Why the kernel log is not read (None while it is)."""
        return self._off_reason

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self._off_reason = f"cannot read {self.path}: {e.strerror}"
            log.info("kernel-log Xids off: %s (NVML's Xid events still count)", self._off_reason)
            return
        # /dev/kmsg: skip the records logged before us (a FIFO cannot seek: it only holds
        # what is written from now on)
        with contextlib.suppress(OSError):
            os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd

    def poll(self) -> list[KernelXid]:
        if self._fd is None:
            return []
        found: list[KernelXid] = []
        read = records = 0
        while read < self.max_bytes and records < self.max_records:
            try:
                chunk = os.read(self._fd, min(self.max_line + 1, self.max_bytes - read))
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # /dev/kmsg: records overwritten before we read them
                    continue
                if e.errno == errno.EINVAL:  # a record larger than the buffer: skip it
                    self.dropped_lines += 1
                    continue
                self._off_reason = f"reading {self.path} failed: {e.strerror}"
                log.warning("kernel-log Xids off: %s", self._off_reason)
                self.close()
                break
            if not chunk:
                break  # a FIFO with no writer, or the end of a file
            read += len(chunk)
            records += 1
            found.extend(self._lines(chunk))
        return found

    def _lines(self, chunk: bytes) -> list[KernelXid]:
        out: list[KernelXid] = []
        data = self._buf + chunk
        *lines, rest = data.split(b"\n")
        for line in lines:
            if self._skipping:
                self._skipping = False
                continue
            if len(line) > self.max_line:
                self.dropped_lines += 1
                continue
            found = parse_kernel_line(line.decode("utf-8", "replace"))
            if found is not None:
                out.append(found)
        if len(rest) > self.max_line:  # no newline in sight: drop the record, resync at one
            if not self._skipping:
                self.dropped_lines += 1
            self._skipping = True
            rest = b""
        self._buf = rest
        return out

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
