"""``otel-gpu run [options] -- CMD ARGS...``: launch a command and watch it."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from otel_gpu.agent.session import AgentInputs, SessionPart
from otel_gpu.agent.settings import RUN_OPTIONS, Settings
from otel_gpu.commands.common import (
    add_agent_options,
    add_command,
    build_resource,
    job_environment,
    settings_from_args,
    setup_logging,
)
from otel_gpu.core.channel import WATCHED_BY_ENV
from otel_gpu.core.errors import UsageError
from otel_gpu.core.job_identity import (
    SERVICE_NAME_ENV,
    default_service_name,
    ensure_job_id,
    given_service_name,
)
from otel_gpu.core.runtime_dir import RUNTIME_DIR_ENV, runtime_dir
from otel_gpu.core.settings import add_options
from otel_gpu.diagnose.collectives import flight_recorder_env
from otel_gpu.outputs.run_outputs import RunOutputs, add_output_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "run",
        "launch a command and watch its process tree and GPUs",
        """Launch CMD, watch its whole process tree and its GPUs
        (CUDA_VISIBLE_DEVICES), export metrics, detect leaks and stalls, forward
        SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to it, and exit with its exit
        code (128+N when a signal N ended it).""",
    )
    add_agent_options(parser)
    add_options(parser, RUN_OPTIONS)
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
    directory = hand_to_trainer(env, settings, given_flags(args))
    if settings.flight_recorder:
        env.update(flight_recorder_env(env, directory))
    session = AgentSession(
        settings,
        LaunchedCommand(cmd, env),
        resource=lambda: build_resource(args.service_name, cmd, settings, env),
        outputs=lambda: RunOutputs(args, f"otel-gpu run {job_title(cmd)}"),
        parts=[
            NodeLock(settings.lock_dir, os.environ.get("CUDA_VISIBLE_DEVICES")),
            TrainerJoin(directory),
        ],
        env=env,  # the detection settings, and the job's service.name for notifications
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


class TrainerJoin(SessionPart):
    """The job's trainers polled after each sweep (:mod:`otel_gpu.agent.trainers`) in
    ``directory``, the runtime directory the job was handed: their phase and step reach the
    detectors, the view, the recording and the summary."""

    name = "trainer join"

    def __init__(self, directory: str) -> None:
        from otel_gpu.agent.trainers import TrainerProgress

        self.progress = TrainerProgress(directory)

    def configure(self, inputs: AgentInputs) -> None:
        inputs.progress = self.progress


def given_flags(args: argparse.Namespace) -> set[str]:
    """The agent settings given on the command line (not from the environment)."""
    from otel_gpu.agent.settings import DECLARED
    from otel_gpu.core.settings import given

    return {name for name, value in given(args, DECLARED).items() if value is not None}


# Each signal's exporter variable of the OpenTelemetry SDK, which the distro defaults to otlp.
SIGNAL_EXPORTERS = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER")


def job_title(cmd: Sequence[str]) -> str:
    """How the live view names the job: the program (``opentelemetry-instrument`` and its
    options passed over, since it only starts the job) and, for Python, the script or
    ``-m`` module: ``python train.py``, ``python -m torch.distributed.run``, ``torchrun``."""
    args = list(cmd)
    if args and os.path.basename(args[0]) == "opentelemetry-instrument":
        args = args[1:]
        while args and args[0].startswith("-"):  # its options all take a value
            args = args[1:] if "=" in args[0] else args[2:]
    if not args:
        return os.path.basename(cmd[0])
    name = os.path.basename(args[0])
    if name.startswith("python") and len(args) > 1:
        if args[1] == "-m" and len(args) > 2:
            return f"{name} -m {args[2]}"
        if not args[1].startswith("-"):
            return f"{name} {os.path.basename(args[1])}"
    return name


def hand_to_trainer(env: dict[str, str], settings: Settings, flags: set[str]) -> str:
    """What the job's processes need from the wrapper, put into ``env`` (the job's): the
    runtime directory their control sockets go to (returned), where their telemetry goes, and
    the in-process part for Python processes started without ``opentelemetry-instrument``.

    Export: each signal's exporter follows the wrapper's (``--exporter``: ``otlp`` is handed
    on; ``prometheus`` is the wrapper's own port and ``console`` the wrapper's stdout, which a
    trainer would write into the job's own output, so neither is; ``none`` is none), and
    ``--endpoint`` / ``--export-interval`` are passed on; a variable the user set in the job's
    environment is always left as it is."""
    user = dict(env)
    directory = runtime_dir(env)
    env[RUNTIME_DIR_ENV] = directory
    env[WATCHED_BY_ENV] = str(os.getpid())  # the trainers leave their last progress at exit
    names = [n for n in settings.exporters if n == "otlp"]
    for variable in SIGNAL_EXPORTERS:
        if variable not in user:
            env[variable] = ",".join(names) or "none"
    if "endpoint" in flags and settings.endpoint and "OTEL_EXPORTER_OTLP_ENDPOINT" not in user:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = settings.endpoint
    if "export_interval_s" in flags and "OTEL_METRIC_EXPORT_INTERVAL" not in user:
        env["OTEL_METRIC_EXPORT_INTERVAL"] = str(round(settings.export_interval_s * 1000))
    if settings.instrument:
        from otel_gpu.tracing.autoload import AUTOLOAD_DIR

        path = env.get("PYTHONPATH", "")
        parts = [p for p in path.split(os.pathsep) if p and p != AUTOLOAD_DIR]
        env["PYTHONPATH"] = os.pathsep.join([AUTOLOAD_DIR, *parts])
    return directory
