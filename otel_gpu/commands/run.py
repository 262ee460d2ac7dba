"""``otel-gpu run [options] -- CMD ARGS...``: launch a command and watch it."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from otel_gpu.commands.common import (
    add_agent_options,
    build_resource,
    job_environment,
    settings_from_args,
    setup_logging,
)
from otel_gpu.core.errors import UsageError
from otel_gpu.core.job_identity import (
    SERVICE_NAME_ENV,
    default_service_name,
    ensure_job_id,
    given_service_name,
)
from otel_gpu.outputs.run_outputs import RunOutputs, add_output_options


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
    from otel_gpu.agent.jobs import LaunchedCommand
    from otel_gpu.agent.session import AgentSession, NodeLock

    env = shared_identity(job_environment(), args.service_name or default_service_name(cmd))
    session = AgentSession(
        settings,
        LaunchedCommand(cmd, env),
        resource=lambda: build_resource(args.service_name, cmd, settings, env),
        outputs=lambda: RunOutputs(args, f"otel-gpu run {os.path.basename(cmd[0])}"),
        parts=[NodeLock(settings.lock_dir)],
    )
    code = session.run()
    assert code is not None
    return code


def shared_identity(env: dict[str, str], service_name: str) -> dict[str, str]:
    """``env`` (the job's) with the identity the wrapper reports itself: its
    ``otel_gpu.job.id`` (one per run, unless the user gave one) and, unless the user named the
    job's service some other way, its service name. The trainer then reports the same job
    (each process with its own ``service.instance.id``), so the processor joins its
    training.phase with these GPUs and the fleet gateway sends both to one replica."""
    ensure_job_id(env)
    if service_name != given_service_name(env):
        env[SERVICE_NAME_ENV] = service_name
    return env
