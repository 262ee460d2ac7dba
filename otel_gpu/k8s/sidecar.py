"""The Kubernetes side of a sidecar session: the pod's processes it watches (the session's
job) and, with ``--pod-resources``, the node's GPUs attributed to their pods (a session part).

The sidecar runs in its own container of the pod with ``shareProcessNamespace: true``, so it
sees the server's processes (PID 1 is the pod's pause process: watching its tree is watching
the pod). Nothing is ever sent to the watched processes unless ``OTEL_GPU_STOP_ON_ALERT`` asks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from otel_gpu.agent.session import AgentInputs, SessionPart
from otel_gpu.core.commandline import PYTHON, python_target
from otel_gpu.core.errors import UsageError
from otel_gpu.k8s.pod import (
    POD_ROOT_PID,
    KubernetesResourceDetector,
    pod_visible_devices,
    visible_pids,
    watched_pod_pids,
)
from otel_gpu.k8s.podlogs import DEFAULT_POD_LOGS

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    from otel_gpu.agent.agent import Agent
    from otel_gpu.k8s.attribution import NodeAttribution
    from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.sidecar")

MATCH_POLL_S = 1.0  # how often the processes are looked at until one matches --match


class PodProcesses:
    """Every process of the pod (PID 1's tree), or those named by ``match`` and their
    children once one runs; watched until SIGINT or SIGTERM (what Kubernetes sends)."""

    name = "the pod's processes"
    command: list[str] | None = None
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)

    def __init__(
        self,
        match: list[str] | None,
        env: Mapping[str, str],
        *,
        proc_root: str = "/proc",
        pod_resources: str | None = None,
        health: str | None = None,
    ) -> None:
        """``match``: executable names (``--match``); ``env``: the sidecar's environment (the
        downward API's pod name); ``pod_resources``: the kubelet's PodResources socket, which
        names the pod's GPUs when it can; ``health``: where ``/healthz`` is served, for the
        log line that says what is watched (a pod's log has no live view)."""
        self.health = health
        self.match = match
        self.env = env
        self.proc_root = proc_root
        self.pod_resources = pod_resources
        self.roots: list[int] = []
        self.pod_pids: list[int] = []
        self.stopping = threading.Event()

    def on_signal(self, signum: int) -> None:
        self.stopping.set()

    def find(self) -> bool:
        """PID 1's tree, or the processes named by ``match`` once one runs (False: stopped)."""
        if not self.match:
            self.roots = [POD_ROOT_PID]
        else:
            if any(not name.strip() for name in self.match):
                raise UsageError("--match needs a process name, e.g. --match vllm")
            while not self.stopping.is_set():
                found = visible_pids(self.proc_root)
                self.roots = [pid for pid in found if _named(pid, self.match, self.proc_root)]
                if self.roots:
                    break
                self.stopping.wait(MATCH_POLL_S)
            else:
                return False
        self.pod_pids = watched_pod_pids(self.roots, bool(self.match), self.proc_root)
        return True

    def resource(self) -> Resource:
        """The pod's ``k8s.*`` attributes (empty outside Kubernetes)."""
        return KubernetesResourceDetector(self.pod_pids, self.env, self.proc_root).detect()

    def launch(self) -> AgentInputs:
        visible = None
        if self.pod_resources:
            from otel_gpu.k8s.attribution import kubelet_pod_devices

            visible = kubelet_pod_devices(self.pod_resources, self.env)
        if visible is None:
            visible = pod_visible_devices(self.env, self.pod_pids, self.proc_root)
        log.info("watching PIDs %s; health on %s", self.roots, self.health or "(off)")
        return AgentInputs(roots=self.roots, visible_devices=visible)

    def agent_failed(self, exc: Exception) -> None:
        raise exc  # a sidecar without its agent has nothing to report: let the pod restart it

    def wait(self) -> None:
        self.stopping.wait()

    def end(self) -> None:
        return


def _named(pid: int, names: list[str], proc_root: str) -> bool:
    """The process's executable name (comm, or argv[0]'s basename) contains one of ``names``;
    for a Python interpreter, also the script's file name or the ``-m`` module it runs
    (``--match train`` finds ``python train.py``)."""
    try:
        with open(os.path.join(proc_root, str(pid), "comm"), encoding="utf-8") as f:
            comm = f.read().strip()
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read(4096).split(b"\0")]
    except OSError:
        return False
    argv0 = os.path.basename(argv[0]) if argv else ""
    seen = [comm, argv0]
    if PYTHON.match(argv0) or PYTHON.match(comm):
        target = python_target([a for a in argv[1:] if a])
        if target.kind == "script":
            seen.append(os.path.basename(target.value))
        elif target.kind == "module":
            seen.append(target.value)
    return any(name in text for name in names for text in seen)


class PodAttribution(SessionPart):
    """Each GPU and process of the node attributed to its pod (``k8s.*`` on their series,
    ``otel_gpu.gpu.allocated``, ``otel_gpu.gpu.memory.orphaned``), refreshed on its own
    thread from the agent's latest snapshot (:class:`otel_gpu.k8s.attribution.NodeAttribution`)."""

    name = "attribution"

    def __init__(
        self,
        socket_path: str,
        *,
        proc_root: str = "/proc",
        pod_logs: str | None = None,
        interval_s: float = 10.0,
    ) -> None:
        """``interval_s``: the agent's sampling period; attribution refreshes at most every
        10 s."""
        self.socket_path = socket_path
        self.proc_root = proc_root
        self.pod_logs = pod_logs or DEFAULT_POD_LOGS
        self.period_s = max(interval_s, 10.0)
        self.attribution: NodeAttribution | None = None
        self._agent: Agent | None = None

    def configure(self, inputs: AgentInputs) -> None:
        from otel_gpu.k8s.attribution import NodeAttribution

        self.attribution = NodeAttribution(
            self._latest,
            self.socket_path,
            proc_root=self.proc_root,
            pod_logs=self.pod_logs,
            period_s=self.period_s,
        )
        inputs.series_labels = self.attribution.series_labels

    def _latest(self) -> Snapshot | None:
        agent = self._agent
        return agent.sampler.fresh() if agent is not None else None

    def attach(self, agent: Agent, provider: MeterProvider) -> None:
        self._agent = agent
        if self.attribution is not None:
            self.attribution.register_instruments(provider.get_meter("otel_gpu"))

    def start(self) -> None:
        if self.attribution is not None:
            self.attribution.start()

    def stop(self, timeout_s: float) -> None:
        if self.attribution is not None:
            self.attribution.stop(timeout_s)
