"""One agent session: the start-up and shutdown sequence every watching command shares.

``otel-gpu run``, ``watch``, ``sidecar`` and ``demo`` differ in what they watch (a
:class:`~otel_gpu.agent.jobs.Job`: a launched command, a running tree, the pod's processes,
the demo's workload) and in what they add (:class:`SessionPart`: the sidecar's ``/readyz`` and
server metrics, the node lock); the order below is the same for all of them, and it lives only
here, in :meth:`AgentSession.run`:

1. **prepare** — everything that can refuse a bad setting, before anything runs: detection
   settings resolved, the health endpoint bound (with the parts' routes), the outputs opened
   (view, summary, recording), each part prepared (the node lock is taken before the job
   starts, so an auto-instrumented job does not sample the node twice). A
   :class:`~otel_gpu.core.errors.UsageError` here means nothing was started.
2. **signals** — the job's signal handlers, before the job exists: a Ctrl-C between starting
   the job and installing them would end otel-gpu and leave the job running unsupervised.
3. **find** — what is watched (the sidecar waits for ``--match``); a stop asked meanwhile ends
   the session here.
4. **export** — the meter provider and its resource (a bad exporter setting refuses here,
   still before the launch).
5. **launch** — from here on the job runs whatever happens to the agent.
6. **attach** — the agent built from the job's and the parts' inputs, the parts and the
   outputs attached, the agent and the parts started, the health check pointed at the agent,
   the view started. If this fails, the job decides (:meth:`Job.agent_failed`): a launched
   command runs on unwatched and ``/healthz`` says why; the others end.
7. **wait** — until the job ends or is asked to stop.
8. **close** — the signal handlers restored (a second Ctrl-C interrupts otel-gpu's own
   shutdown), the parts, the agent and the meter provider closed in parallel within one
   ``OTEL_GPU_SHUTDOWN_TIMEOUT``, the health endpoint closed, the job's own leftovers ended
   (:meth:`Job.end`), the outputs finished (last frame, recording closed, summary).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from otel_gpu.agent.health import AgentEndpoints, Check
from otel_gpu.agent.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_gpu.agent.agent import Agent
    from otel_gpu.agent.labels import SeriesLabels
    from otel_gpu.agent.trainers import TrainerProgress
    from otel_gpu.agent.watchdog import DetectionSettings, InProcessTrainer, Watchdog
    from otel_gpu.sampling.source import DeviceSource

log = logging.getLogger("otel_gpu.session")

# The close when the job was never launched (it could not start, or a stop came first):
# nothing was watched, so nothing is worth waiting for a collector that may be down.
UNLAUNCHED_CLOSE_S = 1.0


@dataclass
class AgentInputs:
    """What the agent is built from besides its settings: the job's launch fills the first
    two, the parts add what they know (:meth:`SessionPart.configure`)."""

    roots: Sequence[int]  # the watched process trees
    visible_devices: str | None = None  # the job's CUDA_VISIBLE_DEVICES
    source: DeviceSource | None = None  # an injected GPU source (the demo's simulated one)
    watchdog: Watchdog | None = None  # a watchdog built by the caller (the demo's windows)
    trainer: InProcessTrainer | None = None  # the trainer's phase, step and graceful stop
    phase: Callable[[], str | None] | None = None  # the detectors' phase otherwise
    series_labels: Callable[[], SeriesLabels] | None = None  # extra series attributes (k8s.*)
    progress: TrainerProgress | None = None  # the trainers' phase and step (agent/trainers.py)


class Job(Protocol):
    """What a session watches and how it ends (implementations: :mod:`otel_gpu.agent.jobs`,
    the sidecar's pod, the demo's workload)."""

    @property
    def name(self) -> str:
        """For the view's first line: ``train``, ``the pod's processes``."""

    @property
    def command(self) -> list[str] | None:
        """For the summary."""

    @property
    def signals(self) -> tuple[int, ...]:
        """Handled by :meth:`on_signal` from before the launch until the close."""

    def on_signal(self, signum: int) -> None:
        """A handled signal arrived (on the main thread; may come before the launch)."""

    def find(self) -> bool:
        """Wait until there is something to watch; False: asked to stop first."""

    def launch(self) -> AgentInputs | None:
        """Start (or take) the job: what the agent watches; None: asked to stop first."""

    def agent_failed(self, exc: Exception) -> None:
        """The agent could not be built or started: raise to end the session, or return to
        let the job run on unwatched."""

    def wait(self) -> int | None:
        """Until the job ends or is asked to stop: its exit code (None: not ours to report)."""

    def end(self) -> None:
        """After the close: end what the session still owns of the job (the demo's child)."""


class SessionPart:
    """Something a command adds to a session. Every hook is optional; the defaults do
    nothing. Hooks run on the main thread in the order of :meth:`AgentSession.run`."""

    name = "part"  # names the part's shutdown step in a log line when it is late

    def routes(self) -> Mapping[str, Check]:
        """More health paths (path → check) served beside ``/healthz``."""
        return {}

    def prepare(self) -> None:
        """Before the job starts; raise UsageError to refuse a bad setting."""

    def configure(self, inputs: AgentInputs) -> None:
        """Before the agent is built: add to what it is built from."""

    def attach(self, agent: Agent, provider: MeterProvider) -> None:
        """The agent is built, not started: register instruments, add listeners."""

    def start(self) -> None:
        """The agent has started."""

    def stop(self, timeout_s: float) -> None:
        """In the bounded close, beside the agent's; called for every prepared part, started
        or not."""


class NodeLock(SessionPart):
    """Owns the node (:mod:`otel_gpu.agent.node_lock`) before the job starts, so an
    auto-instrumented job's processes do not sample it a second time. Held for the life of
    this process; not owning it does not stop the session (the lock only restrains the
    in-process agents)."""

    name = "node lock"

    def __init__(self, lock_dir: str | None = None, visible: str | None = None) -> None:
        """``lock_dir``: ``OTEL_GPU_LOCK_DIR`` (default: a private folder in the temp dir);
        ``visible``: the job's ``CUDA_VISIBLE_DEVICES`` (the lock is per GPU set)."""
        self.lock_dir = lock_dir
        self.visible = visible
        self.owned: bool | None = None  # None until prepared

    def prepare(self) -> None:
        from otel_gpu.agent.node_lock import acquire_node_lock

        self.owned = acquire_node_lock(self.lock_dir, self.visible, say=False)


class Outputs(Protocol):
    """What a person sees locally (:class:`otel_gpu.outputs.run_outputs.RunOutputs`)."""

    def attach(self, sampler: Any, watchdog: Any, progress: Any = None) -> None: ...

    def start(
        self, name: str, pid: int, settings: Any, resource: Mapping[str, Any] | None = None
    ) -> None: ...

    def job_exited(self, root: int, timeout_s: float) -> None: ...

    def finish(self, exit_code: int | None, command: list[str] | None = None) -> None: ...


class AgentSession:
    """prepare → find → export → launch → attach → wait → close, in :meth:`run`.

    ``resource``: the exported resource, built at the export step (after the job was found:
    the sidecar's names the pod). ``outputs``: opened at the prepare step, after the health
    endpoint is bound, so a busy ``--health`` port is refused before a recording is created.
    ``extra_readers``: metric readers beside the exporters' (the demo's in-memory one).
    ``env``: where the detection settings are read (default: this process's environment).
    """

    def __init__(
        self,
        settings: Settings,
        job: Job,
        *,
        resource: Callable[[], Resource],
        outputs: Callable[[], Outputs] | None = None,
        parts: Sequence[SessionPart] = (),
        extra_readers: Sequence[MetricReader] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.job = job
        self.parts = list(parts)
        self.agent: Agent | None = None
        self.provider: MeterProvider | None = None
        self.resource: Resource | None = None  # the exported one, once built
        self.detection: DetectionSettings | None = None
        self.endpoints: AgentEndpoints | None = None
        self.outputs: Outputs | None = None
        self._resource = resource
        self._open_outputs = outputs
        self._extra_readers = list(extra_readers)
        self._env = env
        self._prepared: list[SessionPart] = []
        self._previous: dict[int, Any] = {}

    def run(self) -> int | None:
        """The whole session; the job's exit code (None: not ours to report)."""
        self.prepare()
        self._handle_signals()
        inputs: AgentInputs | None = None
        code: int | None = None
        try:
            if not self.job.find():
                return None
            self.provider = self._meter_provider()
            inputs = self.job.launch()
            if inputs is not None:
                self.attach(inputs)
            code = self.job.wait()
            if code is not None and self.agent is not None and self.outputs is not None:
                # One more sweep: processes the job started that still hold a GPU (summary and
                # orphan alerts), bounded.
                assert inputs is not None
                self.outputs.job_exited(inputs.roots[0], self.settings.interval_s + 2.0)
            return code
        finally:
            self._restore_signals()
            try:
                self.close(self.settings.shutdown_timeout_s if inputs else UNLAUNCHED_CLOSE_S)
            finally:  # even when a second Ctrl-C interrupts the close
                self.job.end()
            if self.agent is not None and self.outputs is not None:
                self.outputs.finish(code, self.job.command)

    def prepare(self) -> None:
        """Step 1: resolve, bind and open everything that can refuse, before anything runs."""
        from otel_gpu.agent.watchdog import DetectionSettings

        # Resolved now: a bad OTEL_GPU_* setting refuses to start, never runs the job unwatched.
        self.detection = DetectionSettings.load(self._env) if self.settings.detect else None
        routes: dict[str, Check] = {}
        for part in self.parts:
            routes.update(part.routes())
        self.endpoints = AgentEndpoints(self.settings, routes)
        try:
            if self._open_outputs is not None:
                self.outputs = self._open_outputs()
            for part in self.parts:
                part.prepare()
                self._prepared.append(part)
        except BaseException:
            self.close(UNLAUNCHED_CLOSE_S)
            raise

    def attach(self, inputs: AgentInputs) -> None:
        """Step 6: build, attach and start the agent; a failure is the job's to judge."""
        from otel_gpu.agent.agent import Agent

        assert self.endpoints is not None and self.provider is not None
        try:
            for part in self.parts:
                part.configure(inputs)
            self.agent = Agent(
                self.settings,
                meter_provider=self.provider,
                roots=inputs.roots,
                source=inputs.source,
                visible_devices=inputs.visible_devices,
                trainer=inputs.trainer,
                export_health=self.endpoints.export_health,
                phase=inputs.phase,
                detection=self.detection,
                series_labels=inputs.series_labels,
                watchdog=inputs.watchdog,
                progress=inputs.progress,
            )
            for part in self.parts:
                part.attach(self.agent, self.provider)
            if self.outputs is not None:
                self.outputs.attach(
                    self.agent.sampler, self.agent.watchdog, progress=inputs.progress
                )
            self.agent.start()
            for part in self.parts:
                part.start()
            self.endpoints.attach(self.agent)
            if self.outputs is not None:
                resource = self.resource.attributes if self.resource is not None else None
                self.outputs.start(self.job.name, inputs.roots[0], self.settings, resource)
        except Exception as exc:
            self.job.agent_failed(exc)  # raises unless the job runs on unwatched
            self.endpoints.agent_failed(str(exc))

    def close(self, timeout_s: float) -> bool:
        """Step 8 (without the outputs): parts, agent and meter provider closed in parallel
        within ``timeout_s`` in all, then the health endpoint. True if all finished in time."""
        from otel_gpu.core.shutdown import close_all, shutdown_provider

        steps: list[tuple[str, Callable[[float], object]]] = [
            (part.name, part.stop) for part in self._prepared
        ]
        if self.agent is not None:
            steps.append(("agent", self.agent.shutdown))
        provider = self.provider
        if provider is not None:
            steps.append(("metrics", lambda t: shutdown_provider(provider, t)))
        finished = close_all(steps, timeout_s)
        if self.endpoints is not None:
            self.endpoints.close()
        return finished

    def _meter_provider(self) -> MeterProvider:
        from otel_gpu.agent.export import meter_provider

        assert self.endpoints is not None
        self.resource = self._resource()
        return meter_provider(
            self.settings,
            self.resource,
            extra_readers=self._extra_readers,
            export_health=self.endpoints.export_health,
        )

    def _handle_signals(self) -> None:
        job = self.job

        def handler(signum: int, _frame: object) -> None:
            job.on_signal(signum)

        self._previous = {sig: signal.signal(sig, handler) for sig in job.signals}

    def _restore_signals(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
