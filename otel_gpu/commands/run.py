"""``otel-gpu run [options] -- CMD ARGS...``: launch a command and watch it."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from otel_gpu.commands.common import (
    AgentEndpoints,
    add_agent_options,
    build_resource,
    job_environment,
    settings_from_args,
    setup_logging,
)
from otel_gpu.commands.outputs import RunOutputs, add_output_options
from otel_gpu.core.errors import UsageError
from otel_gpu.core.job_identity import SERVICE_NAME_ENV, ensure_instance_id, given_service_name

log = logging.getLogger("otel_gpu.run")

# Signals passed on to the job. The job runs in its own process group, and a signal goes to the
# whole group, as a terminal's Ctrl-C would: launchers such as `swift` orphan their trainer when
# only they get SIGTERM (docs/background.md §4).
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "run",
        help="launch a command and watch its process tree and GPUs",
        description="Launch CMD, watch its whole process tree and its GPUs (CUDA_VISIBLE_DEVICES), "
        "export metrics, detect leaks and stalls, forward SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/"
        "SIGUSR2 to it, and exit with its exit code (128+N when a signal N ended it).",
    )
    add_agent_options(parser)
    add_output_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    parser.set_defaults(func=run)


def job_command(raw: Sequence[str]) -> list[str]:
    cmd = list(raw)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError(
            "no command to run: put it after '--', e.g. otel-gpu run -- python train.py"
        )
    program = cmd[0]
    if "/" in program or shutil.which(program) is None:
        _check_program(program)
    return cmd


def _check_program(program: str) -> None:
    """Say what is wrong with a program that cannot be run: missing, a directory, no x bit."""
    path = Path(program)
    if path.is_dir():
        raise UsageError(f"{program!r} is a directory, not a command: name the program to run")
    if "/" not in program:
        if path.exists():  # a file here, which exec does not look for without a path
            raise UsageError(
                f"command not found: {program!r} (to run the file in this directory, "
                f"give its path: ./{program})"
            )
        raise UsageError(f"command not found: {program!r} (check the name or give its full path)")
    if not path.exists():
        raise UsageError(f"command not found: {program!r} (no such file)")
    if not os.access(path, os.X_OK):
        raise UsageError(
            f"{program!r} is not executable: chmod +x it, or run it with its interpreter "
            f"(e.g. bash {program} or python {program})"
        )


def run(args: argparse.Namespace) -> int:
    cmd = job_command(args.command)
    settings = settings_from_args(args)
    setup_logging(args.verbose)
    from otel_gpu.agent.agent import Agent, acquire_node_lock
    from otel_gpu.agent.export import meter_provider
    from otel_gpu.agent.watchdog import DetectionSettings
    from otel_gpu.core.job_identity import default_service_name
    from otel_gpu.core.shutdown import close_all, shutdown_provider

    # Resolved now: a bad OTEL_GPU_* setting refuses to start, never runs the job unwatched.
    detection = DetectionSettings.load() if settings.detect else None
    # The health port first: a bad or busy address is refused before a recording is created.
    endpoints = AgentEndpoints(settings)
    outputs = RunOutputs(args, f"otel-gpu run {os.path.basename(cmd[0])}")
    # Own the node before the job starts, so an auto-instrumented job does not sample it twice.
    acquire_node_lock(settings.lock_dir)
    env = shared_identity(job_environment(), args.service_name or default_service_name(cmd))
    provider = meter_provider(
        settings,
        build_resource(args.service_name, cmd, settings, env),
        export_health=endpoints.export_health,
    )
    job: list[subprocess.Popen] = []
    early: list[int] = []  # signals that arrived before the job existed

    def forward(signum: int, _frame: object) -> None:
        if not job:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job[0].pid, signum)

    # Handlers first: a Ctrl-C between starting the job and installing them would end otel-gpu
    # and leave the job (in its own session) running unsupervised.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    agent = None
    code: int | None = None
    try:
        try:
            started, job_pid = start_guarded(cmd, env)
            job.append(started)
        except OSError as exc:
            raise UsageError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None
        for signum in early:
            forward(signum, None)
        try:
            agent = Agent(
                settings,
                meter_provider=provider,
                roots=[job_pid],
                visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                export_health=endpoints.export_health,
                detection=detection,
            )
            outputs.attach(agent.sampler, agent.watchdog)
            agent.start()
            endpoints.attach(agent)
            outputs.start(os.path.basename(cmd[0]), job_pid, settings)
        except Exception as exc:  # the job runs on, unwatched, rather than being harmed
            log.warning("the agent failed to start (%s); %s runs on unwatched", exc, cmd[0])
            endpoints.agent_failed(str(exc))
        code = wait_child(job[0])
        if agent is not None:  # processes it started that still hold a GPU: said, alerted
            outputs.job_exited(job_pid, settings.interval_s + 2.0)
    finally:
        # The job is gone: Ctrl-C interrupts otel-gpu's own shutdown again.
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        steps: list[tuple[str, Callable[[float], object]]] = [
            ("metrics", lambda t: shutdown_provider(provider, t))
        ]
        if agent is not None:
            steps.insert(0, ("agent", agent.shutdown))
        close_all(steps, settings.shutdown_timeout_s if job else 1.0)
        endpoints.close()
        if agent is not None:
            outputs.finish(code, cmd)
    assert code is not None
    return code


def shared_identity(env: dict[str, str], service_name: str) -> dict[str, str]:
    """``env`` (the job's) with the identity the wrapper reports itself: its
    ``service.instance.id`` (one per run, unless the user gave one) and, unless the user named
    the job's service some other way, its service name. The trainer then reports the same
    job, so the processor joins its training.phase with these GPUs and the fleet gateway sends
    both to one replica."""
    ensure_instance_id(env)
    if service_name != given_service_name(env):
        env[SERVICE_NAME_ENV] = service_name
    return env


def start_guarded(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """Start the job in a session of its own, under its guard (agent/job_guard.py), so that it
    dies with this process however this process dies (SIGKILL included): the guard's process
    (to wait for and to signal as the group) and the job's own PID (to watch and show). This
    process holds the only write end of the guard's pipe for as long as it lives."""
    from otel_gpu.agent import job_guard

    if not job_guard.available():
        child = subprocess.Popen(cmd, start_new_session=True, env=env)
        return child, child.pid
    read_fd, write_fd = os.pipe()  # non-inheritable: no other child keeps the write end open
    pid_read, pid_write = os.pipe()
    try:
        child = subprocess.Popen(
            job_guard.guarded(cmd, read_fd, pid_write),
            start_new_session=True,
            env=env,
            pass_fds=(read_fd, pid_write),
        )
    except BaseException:
        os.close(write_fd)
        os.close(pid_read)
        raise
    finally:
        os.close(read_fd)
        os.close(pid_write)
    _GUARD_PIPES.append(write_fd)  # closed by the kernel when this process ends, not before
    with os.fdopen(pid_read, "rb") as reply:  # EOF at once if the guard dies first
        text = reply.readline().strip()
    return child, int(text) if text.isdigit() else child.pid


_GUARD_PIPES: list[int] = []


def wait_child(child: subprocess.Popen) -> int:
    """Wait for the job; its exit code, or 128+N when signal N ended it (as shells report)."""
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:  # pragma: no cover - handlers replace SIGINT while waiting
            continue
    return 128 - code if code < 0 else code
