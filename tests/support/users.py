"""A second real local user for attacks that need two (another user's files in a shared
directory, another user reading ours): ``otelgpu-tenant``, created on first use. Needs root."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

OTHER_USER = "otelgpu-tenant"
OTHER_PYTHON = "/usr/bin/python3"  # the other user cannot read root's virtual environment


def other_user() -> pwd.struct_passwd:
    """The other user's account (created if missing); skips the test when not root."""
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


def as_user(
    user: pwd.struct_passwd, argv: list[str], **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """``argv`` run as ``user`` from ``/`` (output captured, text), to completion."""
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        argv, user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
        capture_output=True, text=True, timeout=60, **kwargs,
    )  # fmt: skip


@contextmanager
def shared_directory() -> Iterator[Path]:
    """A fresh directory like ``/tmp`` or ``/scratch`` (mode 1777) that every user can write,
    removed afterwards."""
    shared = Path(tempfile.mkdtemp(prefix="otel-gpu-test-", dir="/tmp"))
    try:
        shared.chmod(0o1777)
        yield shared
    finally:
        shutil.rmtree(shared, ignore_errors=True)
