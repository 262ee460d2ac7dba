"""``otel-gpu watch --pid PID``: attach to a running process tree until it exits."""

from __future__ import annotations

import argparse
import os
import signal
import threading

import psutil

from otel_gpu.commands.common import (
    AgentEndpoints,
    add_agent_options,
    build_resource,
    settings_from_args,
    setup_logging,
)
from otel_gpu.core.errors import UsageError
from otel_gpu.outputs.run_outputs import RunOutputs, add_output_options
from otel_gpu.sampling.procfs import read_stat

_PID_MAX = 4194304  # the kernel's largest pid_max


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "watch",
        help="attach to a running process tree",
        description="Watch PID and all its descendants and their GPUs until PID exits "
        "(or Ctrl-C). Nothing is sent to the watched processes unless OTEL_GPU_STOP_ON_ALERT "
        "is set, and then only the stop signal to its processes that hold GPU memory.",
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
        root = psutil.Process(args.pid)
        name = root.name()
    except psutil.Error:
        st = None
    if st is None:
        raise UsageError(f"no process with PID {args.pid}: check it with 'ps -p {args.pid}'")
    created = st.starttime
    settings = settings_from_args(args)
    setup_logging(args.verbose)
    from otel_gpu.agent.agent import Agent, acquire_node_lock
    from otel_gpu.agent.export import meter_provider
    from otel_gpu.agent.watchdog import DetectionSettings
    from otel_gpu.core.shutdown import close_all, shutdown_provider

    # Resolved now: a bad OTEL_GPU_* setting refuses to start, never runs the job unwatched.
    detection = DetectionSettings.load() if settings.detect else None

    # The health port first: a bad or busy address is refused before a recording is created.
    endpoints = AgentEndpoints(settings)
    outputs = RunOutputs(args, f"otel-gpu watch {name}")
    acquire_node_lock(settings.lock_dir)
    provider = meter_provider(
        settings,
        build_resource(args.service_name, [name], settings),
        export_health=endpoints.export_health,
    )
    agent = Agent(
        settings,
        meter_provider=provider,
        roots=[args.pid],
        visible_devices=_visible_devices(root),
        export_health=endpoints.export_health,
        detection=detection,
    )
    outputs.attach(agent.sampler, agent.watchdog)
    agent.start()
    endpoints.attach(agent)
    outputs.start(name, args.pid, settings)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            if not _alive(args.pid, created):
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        close_all(
            [("agent", agent.shutdown), ("metrics", lambda t: shutdown_provider(provider, t))],
            settings.shutdown_timeout_s,
        )
        endpoints.close()
        outputs.finish(None, [name])
    return 0


def _alive(pid: int, created: int) -> bool:
    """True while the same process (same start tick: not a reused PID) runs, not a zombie."""
    st = read_stat("/proc", pid)
    return st is not None and st.starttime == created and st.state not in "ZX"


def _visible_devices(root: psutil.Process) -> str | None:
    """The watched job's CUDA_VISIBLE_DEVICES when readable, else the agent's own."""
    try:
        env = root.environ()
    except (psutil.Error, OSError):
        env = {}
    return env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
