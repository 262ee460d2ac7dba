"""``otel-gpu sidecar``: watch a pod's inference server and GPUs; answer /healthz and /readyz.

Runs in its own container of the pod with ``shareProcessNamespace: true``
(:mod:`otel_gpu.k8s.sidecar`); readiness and the server's metrics come from
:mod:`otel_gpu.inference.sidecar`. Nothing is ever sent to the watched processes unless
``OTEL_GPU_STOP_ON_ALERT`` asks for it.
"""

from __future__ import annotations

import argparse
import os

from otel_gpu.agent.settings import SIDECAR_OPTIONS, Settings
from otel_gpu.commands.common import (
    add_agent_options,
    add_command,
    build_resource,
    settings_from_args,
    setup_logging,
)
from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import add_options
from otel_gpu.k8s.podlogs import DEFAULT_POD_LOGS
from otel_gpu.outputs.run_outputs import RunOutputs, add_output_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "sidecar",
        "watch an inference pod (shared PID namespace); /healthz and /readyz",
        """Watch every process of the pod (or those named by --match and their
        children) and the GPUs the pod was given (NVIDIA_VISIBLE_DEVICES or
        CUDA_VISIBLE_DEVICES of the server, else the sidecar's own). With --health,
        /healthz is 200 while sampling is fresh and /readyz 200 while no
        serving-fatal condition holds (a lost GPU, an Xid that needs a reset, memory
        about to run out, requests waiting on idle GPUs). Ends within
        OTEL_GPU_SHUTDOWN_TIMEOUT seconds of SIGTERM.""",
    )
    parser.add_argument(
        "--match",
        metavar="NAME",
        action="append",
        help="watch only processes whose executable name (or, for python, script or -m "
        "module name) contains NAME, and their children "
        "(repeatable; waits until one runs); default: every process of the pod",
    )
    add_options(parser, SIDECAR_OPTIONS)
    parser.add_argument(
        "--pod-resources",
        metavar="SOCKET",
        help="the kubelet's PodResources socket, e.g. "
        "/var/lib/kubelet/pod-resources/kubelet.sock: attribute each GPU of the node to its pod "
        "(the DaemonSet; falls back to the processes' cgroups when it cannot be read) and, with "
        "K8S_POD_NAME and K8S_NAMESPACE_NAME set, take the pod's GPUs from the kubelet",
    )
    parser.add_argument(
        "--pod-logs",
        metavar="DIR",
        help="with --pod-resources: the node's pod log folders, which name each pod by its UID "
        f"and tell which pods the node still runs (default: {DEFAULT_POD_LOGS})",
    )
    add_agent_options(parser)
    add_output_options(parser)
    parser.set_defaults(func=sidecar)


def sidecar_settings(args: argparse.Namespace, env: dict[str, str]) -> Settings:
    """The shared agent settings, with the sidecar's defaults: the executable only in
    ``process.command`` unless OTEL_GPU_PROCESS_COMMAND says otherwise."""
    return settings_from_args(args, env, process_command="executable")


def sidecar(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    settings = sidecar_settings(args, env)
    if args.pod_logs is not None and not args.pod_resources:  # else silently unused
        raise UsageError(
            f"--pod-logs {args.pod_logs}: the pod log folders only name the pods of the node's "
            "GPUs with --pod-resources; add --pod-resources SOCKET or drop --pod-logs"
        )
    setup_logging(args.verbose)
    from otel_gpu.agent.session import AgentSession, SessionPart
    from otel_gpu.inference.sidecar import ServingReadiness
    from otel_gpu.k8s.sidecar import PodAttribution, PodProcesses

    pod = PodProcesses(
        args.match,
        env,
        proc_root=settings.proc_root,
        pod_resources=args.pod_resources,
        health=settings.health,
    )
    parts: list[SessionPart] = [ServingReadiness(env, settings.server_metrics, settings.interval_s)]
    if args.pod_resources:
        parts.append(
            PodAttribution(
                args.pod_resources,
                proc_root=settings.proc_root,
                pod_logs=args.pod_logs,
                interval_s=settings.interval_s,
            )
        )
    # In a pod stderr is the pod's log: the live view only when asked for (--view); a
    # recording and the summary JSON work as for run and watch.
    args.quiet = not args.view
    session = AgentSession(
        settings,
        pod,
        resource=lambda: build_resource(
            args.service_name or "otel-gpu-sidecar", None, settings
        ).merge(pod.resource()),
        outputs=lambda: RunOutputs(args, "otel-gpu sidecar"),
        parts=parts,
        env=env,
    )
    session.run()
    return 0
