"""``otel-gpu watch --pid PID``: attach to a running process tree until it exits."""

from __future__ import annotations

import argparse
import os

import psutil

from otel_gpu.commands.common import (
    add_agent_options,
    add_command,
    build_resource,
    settings_from_args,
    setup_logging,
)
from otel_gpu.core.errors import UsageError
from otel_gpu.outputs.run_outputs import RunOutputs, add_output_options
from otel_gpu.sampling.procfs import read_stat

_PID_MAX = 4194304  # the kernel's largest pid_max


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "watch",
        "attach to a running process tree",
        """Watch PID and all its descendants and their GPUs until PID exits (or
        Ctrl-C). Nothing is sent to the watched processes unless
        OTEL_GPU_STOP_ON_ALERT is set, and then only the stop signal to its
        processes that hold GPU memory.""",
    )
    parser.add_argument("--pid", type=int, required=True, help="root PID of the job to watch")
    add_agent_options(parser)
    add_output_options(parser)
    parser.set_defaults(func=watch)


def watch(args: argparse.Namespace) -> int:
    if args.pid == 1:
        # PID 1's tree is every process of the host (or container): the job would be everything.
        raise UsageError(
            "--pid 1 is init, whose tree is every process here, not a job: give the PID of "
            "the job's own root process (e.g. from 'pgrep -f train.py')"
        )
    if not 0 < args.pid <= _PID_MAX or not psutil.pid_exists(args.pid):
        raise UsageError(f"no process with PID {args.pid}: check it with 'ps -p {args.pid}'")
    st = read_stat("/proc", args.pid)
    try:
        name = psutil.Process(args.pid).name()
    except psutil.Error:
        st = None
    if st is None:
        raise UsageError(f"no process with PID {args.pid}: check it with 'ps -p {args.pid}'")
    settings = settings_from_args(args)
    setup_logging(args.verbose)
    from otel_gpu.agent.jobs import RunningTree
    from otel_gpu.agent.session import AgentSession, NodeLock

    session = AgentSession(
        settings,
        RunningTree(args.pid, st.starttime, name),
        resource=lambda: build_resource(args.service_name, [name], settings),
        outputs=lambda: RunOutputs(args, f"otel-gpu watch {name}"),
        parts=[NodeLock(settings.lock_dir, os.environ.get("CUDA_VISIBLE_DEVICES"))],
    )
    session.run()
    return 0
