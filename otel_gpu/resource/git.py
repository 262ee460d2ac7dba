"""Git provenance of the running code as resource attributes (``vcs.*``).

Uses the ``git`` command line (not GitPython): every call runs in its own process group under
one overall deadline and is killed with its children when the deadline passes, so a hung
network filesystem or a slow ``git`` can't hold up start-up. ``GIT_OPTIONAL_LOCKS=0`` keeps
``git status`` from taking the index lock the user's own git commands need.

The repository URL is reported as semconv asks for ``vcs.repository.url.full``: the canonical
address a browser opens. Credentials (``user:token@``), query and fragment are dropped, ``.git``
is removed, and SSH forms (``git@host:org/repo.git``, ``ssh://git@host:22/org/repo``) become
``https://host/org/repo``. Local-path remotes are reported as ``file://`` URLs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource, ResourceDetector
from opentelemetry.util.types import AttributeValue

from otel_gpu.core.channel import WATCHED_BY_ENV

log = logging.getLogger("otel_gpu.resource")

# Extensions (semconv has no dirty flag and no submodule list).
VCS_DIRTY = "otel_gpu.vcs.dirty"  # bool: tracked files differ from HEAD
VCS_SUBMODULES = "otel_gpu.vcs.submodules"  # string[]: "path@sha" of checked-out submodules

DEFAULT_TIMEOUT_S = 2.0  # whole detection; below the SDK's 5 s per-detector limit
ENV_GIT_DIR = "OTEL_GPU_GIT_DIR"

# scp-like syntax: [user@]host:path, where path does not start with "/" after the colon+"//".
_SCP = re.compile(r"^(?:[^@/]+@)?(?P<host>[^:/\[\]]+|\[[^\]]+\]):(?P<path>(?!//).*)$")
_SSH_LIKE = {"ssh", "git", "git+ssh", "ssh+git"}


class GitError(Exception):
    """git could not answer; the message says why and what to do."""


def canonical_repo_url(url: str, base_dir: str | None = None) -> str | None:
    """The browser URL of a remote, without credentials or ``.git``; None if it has no host.

    >>> canonical_repo_url("https://user:ghp_x@github.com/org/repo.git")
    'https://github.com/org/repo'
    >>> canonical_repo_url("git@gitlab.example.com:group/sub/repo.git")
    'https://gitlab.example.com/group/sub/repo'
    """
    url = url.strip()
    if not url:
        return None
    port = ""
    if "://" in url:
        try:
            parts = urlsplit(url)
            host = parts.hostname
            scheme = parts.scheme.lower()
            if scheme in ("http", "https") and parts.port:
                port = f":{parts.port}"
        except ValueError:
            return None
        path = parts.path
        if scheme == "file":
            return "file://" + _trim(path)
        if scheme in _SSH_LIKE:
            scheme = "https"  # the SSH port is not the web server's
        if not host:
            return None
        if ":" in host:
            host = f"[{host}]"
    elif (m := _SCP.match(url)) and not url.startswith(("/", ".")):
        scheme, host, path = "https", m.group("host").lower(), "/" + m.group("path")
    else:
        path = os.path.normpath(os.path.join(base_dir or os.getcwd(), url))
        return "file://" + _trim(path)
    return f"{scheme}://{host}{port}{_trim(path)}"


def _trim(path: str) -> str:
    return path.rstrip("/").removesuffix(".git").rstrip("/")


class _Git:
    """Runs git commands in ``cwd`` until one shared deadline."""

    def __init__(self, cwd: str, timeout_s: float, env: Mapping[str, str] | None = None) -> None:
        self.cwd = cwd
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.env = dict(os.environ if env is None else env)
        self.env.update(GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0", LC_ALL="C")

    def run(self, *args: str) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); raises GitError when git is missing or too slow."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise GitError(f"git did not answer within {self.timeout_s:g} s")
        try:
            proc = subprocess.Popen(
                ["git", *args],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # so a timeout kills git's children too
            )
        except FileNotFoundError as exc:
            raise GitError("git is not installed (no `git` on PATH)") from exc
        except OSError as exc:
            raise GitError(f"cannot run git in {self.cwd}: {exc.strerror}") from exc
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):  # already gone
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise GitError(f"git did not answer within {self.timeout_s:g} s") from None
        return (
            proc.returncode,
            out.decode("utf-8", "replace").rstrip(),  # keep the status column of line 1
            err.decode("utf-8", "replace").strip(),
        )


def git_attributes(
    cwd: str, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> dict[str, AttributeValue]:
    """``vcs.*`` attributes of the work tree containing ``cwd``; raises GitError with a reason."""
    git = _Git(cwd, timeout_s, env)
    rc, out, err = git.run("rev-parse", "--show-toplevel", "HEAD", "--symbolic-full-name", "HEAD")
    lines = out.splitlines()
    if rc != 0 or len(lines) != 3:
        if "not a git repository" in err:
            raise GitError(f"{cwd} is not inside a git repository")
        if "dubious ownership" in err:
            raise GitError(
                f"git refuses the repository at {cwd} (owned by another user); fix: "
                "git config --global --add safe.directory <repository path>"
            )
        if "unknown revision" in err or "ambiguous argument 'HEAD'" in err:
            raise GitError(f"the repository at {cwd} has no commits yet")
        raise GitError(f"git rev-parse failed in {cwd}: {err.splitlines()[-1] if err else rc}")
    toplevel, revision, symbolic = lines
    attrs: dict[str, AttributeValue] = {"vcs.ref.head.revision": revision}

    if symbolic.startswith("refs/heads/"):
        attrs["vcs.ref.head.name"] = symbolic.removeprefix("refs/heads/")
        attrs["vcs.ref.head.type"] = "branch"
    else:  # detached HEAD: name it only when it sits exactly on a tag
        rc, tag, _ = git.run("describe", "--tags", "--exact-match", "HEAD")
        if rc == 0 and tag:
            attrs["vcs.ref.head.name"] = tag
            attrs["vcs.ref.head.type"] = "tag"

    url = _remote_url(git, toplevel)
    if url:
        attrs["vcs.repository.url.full"] = url
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if name:
            attrs["vcs.repository.name"] = name

    # Untracked files don't make a tree dirty (as in `git describe --dirty`): training
    # directories are full of logs and outputs.
    rc, status, _ = git.run("status", "--porcelain", "--untracked-files=no")
    if rc == 0:
        attrs[VCS_DIRTY] = bool(status)

    if os.path.exists(os.path.join(toplevel, ".gitmodules")):
        rc, subs, _ = git.run("submodule", "status", "--recursive")
        if rc == 0:
            attrs[VCS_SUBMODULES] = _parse_submodules(subs)
    return attrs


def _remote_url(git: _Git, toplevel: str) -> str | None:
    rc, out, _ = git.run("config", "--get-regexp", r"^remote\..*\.url$")
    if rc != 0 or not out:
        return None
    urls: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        urls[key.removeprefix("remote.").removesuffix(".url")] = value
    raw = urls.get("origin") or next(iter(urls.values()))
    return canonical_repo_url(raw, base_dir=toplevel)


def _parse_submodules(text: str) -> list[str]:
    """``git submodule status`` lines -> ["path@sha", ...]; uninitialized ones ("-") skipped."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "-":
            continue
        fields = line[1:].split()
        if len(fields) >= 2:
            out.append(f"{fields[1]}@{fields[0]}")
    return out


class GitResourceDetector(ResourceDetector):
    """``vcs.*`` provenance of the repository around the working directory.

    The start directory is ``cwd``, else ``OTEL_GPU_GIT_DIR``, else the process's working
    directory. Outside a repository (or without git, or when git is slower than ``timeout_s``)
    ``detect()`` logs one warning and returns an empty resource.
    """

    def __init__(
        self,
        raise_on_error: bool = False,
        *,
        cwd: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(raise_on_error)
        self.cwd = cwd
        self.timeout_s = timeout_s

    def detect(self) -> Resource:
        try:
            cwd = self.cwd or os.environ.get(ENV_GIT_DIR) or os.getcwd()
            if not os.path.isdir(cwd):
                raise GitError(f"{ENV_GIT_DIR}={cwd} is not a directory")
            return Resource(git_attributes(cwd, self.timeout_s))
        except GitError as exc:
            log.log(_said_level(), "git provenance not recorded: %s", exc)
        except Exception as exc:  # never break the SDK's start-up
            log.log(_said_level(), "git provenance not recorded: %s: %s", type(exc).__name__, exc)
        return Resource.get_empty()


def _said_level() -> int:
    """A trainer under ``otel-gpu run`` does not repeat the line its wrapper said for the job
    (from the same working directory) into the job's output."""
    return logging.DEBUG if os.environ.get(WATCHED_BY_ENV) else logging.WARNING
