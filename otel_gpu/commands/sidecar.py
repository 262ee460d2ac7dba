"""``otel-gpu sidecar``: watch a pod's inference server and GPUs; answer /healthz and /readyz.

Runs in its own container of the pod with ``shareProcessNamespace: true``, so it sees the
server's processes (PID 1 is the pod's pause process: watching its tree is watching the pod).
Nothing is ever sent to the watched processes unless ``OTEL_GPU_STOP_ON_ALERT`` asks for it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from otel_gpu.agent.settings import SIDECAR_OPTIONS, Settings
from otel_gpu.commands.common import (
    AgentEndpoints,
    add_agent_options,
    build_resource,
    settings_from_args,
    setup_logging,
)
from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import add_options
from otel_gpu.k8s.podlogs import DEFAULT_POD_LOGS
from otel_gpu.outputs.run_outputs import RunOutputs, add_output_options

if TYPE_CHECKING:
    from otel_gpu.agent.watchdog import DetectionSettings
    from otel_gpu.inference.readiness import Readiness
    from otel_gpu.inference.serving import ServingConditions

log = logging.getLogger("otel_gpu.sidecar")

MATCH_POLL_S = 1.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sidecar",
        help="watch an inference pod (shared PID namespace); /healthz and /readyz",
        description="Watch every process of the pod (or those named by --match and their "
        "children) and the GPUs the pod was given (NVIDIA_VISIBLE_DEVICES or "
        "CUDA_VISIBLE_DEVICES of the server, else the sidecar's own). With --health, /healthz "
        "is 200 while sampling is fresh and /readyz 200 while no serving-fatal condition holds "
        "(a lost GPU, an Xid that needs a reset, memory about to run out, requests waiting on "
        "idle GPUs). Ends within OTEL_GPU_SHUTDOWN_TIMEOUT seconds of SIGTERM.",
    )
    parser.add_argument(
        "--match",
        metavar="NAME",
        action="append",
        help="watch only processes whose executable name contains NAME, and their children "
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
    from otel_gpu.agent.watchdog import DetectionSettings
    from otel_gpu.detect.breaker import BreakerConfig
    from otel_gpu.inference.readiness import Readiness, ReadinessConfig
    from otel_gpu.inference.serving import ServingConditions, ServingConfig

    # Resolved now: a bad OTEL_GPU_* setting refuses to start, never runs the job unwatched.
    detection = DetectionSettings.load(env) if settings.detect else None
    # Readiness opens on the first serving-fatal alert, whatever the notify threshold is.
    readiness = Readiness(
        ReadinessConfig.from_env(env), BreakerConfig.from_env(env, alerts_to_open=1)
    )
    serving = ServingConditions(ServingConfig.from_env(env))
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    # In a pod stderr is the pod's log: the live view only when asked for (--view); a
    # recording and the summary JSON work as for run and watch.
    args.quiet = not args.view
    outputs = RunOutputs(args, "otel-gpu sidecar")
    endpoints = AgentEndpoints(settings, {"/readyz": readiness.verdict})
    try:
        roots = _roots(args.match, settings.proc_root, stop)
        if roots is None:
            return 0  # asked to stop before anything matched
        return _watch(
            settings, env, roots, args, readiness, serving, endpoints, outputs, stop, detection
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        endpoints.close()


def _watch(
    settings: Settings,
    env: dict[str, str],
    roots: list[int],
    args: argparse.Namespace,
    readiness: Readiness,
    serving: ServingConditions,
    endpoints: AgentEndpoints,
    outputs: RunOutputs,
    stop: threading.Event,
    detection: DetectionSettings | None,
) -> int:
    from otel_gpu.agent.agent import Agent
    from otel_gpu.agent.export import meter_provider
    from otel_gpu.core.shutdown import close_all, shutdown_provider
    from otel_gpu.k8s.pod import KubernetesResourceDetector, pod_visible_devices, watched_pod_pids

    pod_pids = watched_pod_pids(roots, bool(args.match), settings.proc_root)
    resource = build_resource(args.service_name or "otel-gpu-sidecar", None, settings).merge(
        KubernetesResourceDetector(pod_pids, env, settings.proc_root).detect()
    )
    provider = meter_provider(settings, resource, export_health=endpoints.export_health)
    visible = None
    attribution = None
    if args.pod_resources:
        from otel_gpu.k8s.attribution import NodeAttribution, kubelet_pod_devices

        visible = kubelet_pod_devices(args.pod_resources, env)
        attribution = NodeAttribution(
            lambda: agent.sampler.fresh(),  # bound below, before the attribution starts
            args.pod_resources,
            proc_root=settings.proc_root,
            pod_logs=args.pod_logs or DEFAULT_POD_LOGS,
            period_s=max(settings.interval_s, 10.0),
        )
    if visible is None:
        visible = pod_visible_devices(env, pod_pids, settings.proc_root)
    agent = Agent(
        settings,
        meter_provider=provider,
        roots=roots,
        visible_devices=visible,
        export_health=endpoints.export_health,
        phase=serving.phase,
        detection=detection,
        series_labels=attribution.series_labels if attribution is not None else None,
    )
    scraper = None
    if settings.server_metrics:
        from otel_gpu.inference.scrape import ServerScraper

        scraper = ServerScraper(settings.server_metrics, settings.interval_s)
        scraper.register_instruments(provider.get_meter("otel_gpu"))
    dispatch: Callable[[Any], None] = lambda _t: None  # noqa: E731
    if agent.watchdog is not None:
        agent.watchdog.alert_listeners.append(readiness.on_alert)
        if agent.watchdog.dispatcher is not None:
            dispatch = agent.watchdog.dispatcher.on_transition

    def on_snapshot(snap: Any) -> None:
        # After the watchdog's listener: this sweep's leak alerts have reached readiness.
        utils = [g.util_gpu for g in snap.gpus if g.status == "ok"]
        started, active = serving.observe(snap.time, utils, scraper.fresh() if scraper else None)
        for alert in started:
            log.warning("%s", alert.message)
        for t in readiness.observe(snap, active):
            log.warning("readiness: %s", t.reason)
            if t.subject == "server":  # GPU subjects notify through the agent's own breaker
                dispatch(t)

    agent.sampler.add_listener(on_snapshot)
    outputs.attach(agent.sampler, agent.watchdog)
    if attribution is not None:
        attribution.register_instruments(provider.get_meter("otel_gpu"))
    agent.start()
    for helper in (scraper, attribution):
        if helper is not None:
            helper.start()
    endpoints.attach(agent)
    outputs.start("the pod's processes", roots[0], settings)
    log.info("watching PIDs %s; health on %s", roots, settings.health or "(off)")
    try:
        stop.wait()
    finally:
        steps: list[tuple[str, Callable[[float], object]]] = [
            ("agent", agent.shutdown),
            ("metrics", lambda t: shutdown_provider(provider, t)),
        ]
        if scraper is not None:
            steps.insert(0, ("scrape", scraper.stop))
        if attribution is not None:
            steps.insert(0, ("attribution", attribution.stop))
        close_all(steps, settings.shutdown_timeout_s)
        outputs.finish(None)
    return 0


def _roots(match: list[str] | None, proc_root: str, stop: threading.Event) -> list[int] | None:
    """PID 1's tree, or the processes named by ``--match`` once one runs (None: stopped)."""
    from otel_gpu.k8s.pod import POD_ROOT_PID, visible_pids

    if not match:
        return [POD_ROOT_PID]
    if any(not name.strip() for name in match):
        raise UsageError("--match needs a process name, e.g. --match vllm")
    while not stop.is_set():
        found = [pid for pid in visible_pids(proc_root) if _named(pid, match, proc_root)]
        if found:
            return found
        stop.wait(MATCH_POLL_S)
    return None


def _named(pid: int, names: list[str], proc_root: str) -> bool:
    """The process's executable name (comm, or argv[0]'s basename) contains one of ``names``."""
    try:
        with open(os.path.join(proc_root, str(pid), "comm"), encoding="utf-8") as f:
            comm = f.read().strip()
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            argv0 = os.path.basename(f.read(4096).split(b"\0", 1)[0].decode(errors="replace"))
    except OSError:
        return False
    return any(name in comm or name in argv0 for name in names)
