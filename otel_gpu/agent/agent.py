"""The agent: a sampler, the instruments that read it, and (optionally) the detection engine.

``otel-gpu run`` / ``watch`` / ``sidecar`` / ``demo`` build one in an agent session
(:mod:`otel_gpu.agent.session`). Auto-instrumented processes call
:func:`start_in_process`, which starts one only in the process that wins the node lock, so a
torchrun job with eight ranks still has exactly one sampler per node.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import MeterProvider

from otel_gpu.agent import instruments as metrics
from otel_gpu.agent import selfmetrics
from otel_gpu.agent.labels import SeriesLabels
from otel_gpu.agent.node_lock import acquire_node_lock
from otel_gpu.agent.selfmetrics import ExportHealth
from otel_gpu.agent.settings import Settings
from otel_gpu.core.signals import SCHEMA_URL
from otel_gpu.sampling.isolated import SamplerProcess, SamplerSpec
from otel_gpu.sampling.sampler import Sampler
from otel_gpu.sampling.source import DeviceSource

if TYPE_CHECKING:  # the watchdog (psutil, the engine) is imported only when detection is on
    from otel_gpu.agent.trainers import TrainerProgress
    from otel_gpu.agent.watchdog import DetectionSettings, InProcessTrainer, Watchdog

log = logging.getLogger("otel_gpu.agent")

# New processes in the watched tree are found within this many seconds; between those full
# /proc scans a sweep reads only the known tree and the GPU processes.
DISCOVERY_PERIOD_S = 5.0


def make_source(settings: Settings, visible_devices: str | None = None) -> DeviceSource:
    """The simulated GPU when asked for, else real NVML (which degrades to "no GPU" mode)."""
    if settings.simulate:
        from otel_gpu.sampling.sim import SimulatedSource

        return SimulatedSource(settings.simulate, time_scale=settings.simulate_speed)
    from otel_gpu.sampling.nvml import NvmlSource

    return NvmlSource(
        call_timeout_s=settings.nvml_timeout_s,
        library_path=settings.nvml_library,
        visible_devices=visible_devices,
        kernel_log=settings.kernel_log,
    )


class Agent:
    """Samples GPUs and the watched process tree, exports instruments, runs detection.

    With ``settings.sampler == "process"`` (the default) and no injected ``source``, every NVML
    and /proc read happens in a supervised helper process (:mod:`otel_gpu.sampling.isolated`);
    an injected source object (tests, the demo) is sampled on a thread of this process.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        meter_provider: MeterProvider | None = None,
        roots: Iterable[int] = (),
        source: DeviceSource | None = None,
        visible_devices: str | None = None,
        trainer: InProcessTrainer | None = None,
        export_health: ExportHealth | None = None,
        phase: Callable[[], str | None] | None = None,
        detection: DetectionSettings | None = None,
        series_labels: Callable[[], SeriesLabels] | None = None,
        watchdog: Watchdog | None = None,
        progress: TrainerProgress | None = None,
    ) -> None:
        """``detection``: the engine's, breaker's and actions' settings, resolved where the
        agent is built (default: their defaults); used when ``settings.detect``.
        ``trainer``: the trainer this agent runs inside (:func:`start_in_process`), whose
        phase and step feed detection and whose graceful stop is asked first.
        ``export_health``: where the meter provider's exporter counts its outcomes
        (:func:`otel_gpu.agent.export.meter_provider`), for the self-metrics and ``/healthz``.
        ``phase``: the detectors' phase source when it is not an in-process trainer.
        ``series_labels``: extra attributes of GPU and process series (the DaemonSet's
        ``k8s.*``), looked up at each collection (otel_gpu/agent/labels.py).
        ``watchdog``: detection built by the caller (the demo's shortened windows), used
        whatever ``settings.detect`` says; closed with the agent.
        ``progress``: the trainers' progress over the control channel
        (:mod:`otel_gpu.agent.trainers`), polled after each sweep before detection; its phase
        and step feed detection unless ``trainer`` or ``phase`` is given."""
        self.settings = settings
        roots = tuple(roots)
        self.sampler: Sampler | SamplerProcess
        if source is None and settings.sampler == "process":
            self.sampler = SamplerProcess(
                SamplerSpec(
                    interval_s=settings.interval_s,
                    simulate=settings.simulate,
                    simulate_speed=settings.simulate_speed,
                    nvml_timeout_s=settings.nvml_timeout_s,
                    nvml_library=settings.nvml_library,
                    kernel_log=settings.kernel_log,
                    visible_devices=visible_devices,
                    proc_root=settings.proc_root,
                    max_processes=settings.max_processes,
                    discovery_period_s=DISCOVERY_PERIOD_S,
                    roots=tuple(roots),
                    process_command=settings.process_command,
                    cpu_budget=settings.cpu_budget,
                )
            )
        else:
            from otel_gpu.sampling.procs import ProcessTree

            tree = ProcessTree(
                roots,
                proc_root=settings.proc_root,
                max_processes=settings.max_processes,
                discovery_period_s=DISCOVERY_PERIOD_S,
                command_mode=settings.process_command,
            )
            self.sampler = Sampler(
                source if source is not None else make_source(settings, visible_devices),
                tree,
                interval_s=settings.interval_s,
            )
        self.export_health = export_health if export_health is not None else ExportHealth()
        self.instruments: list[Any] = []
        if meter_provider is not None:
            meter = meter_provider.get_meter("otel_gpu", _version(), schema_url=SCHEMA_URL)
            self.instruments = metrics.register(meter, self.sampler.fresh, labels=series_labels)
            self.instruments += selfmetrics.register(meter, self.sampler, self.export_health)
        if progress is not None:
            self.sampler.add_listener(progress.on_snapshot)  # before the watchdog's
            if trainer is None and phase is None:
                trainer = progress.as_trainer()
        self.watchdog: Any = watchdog
        if watchdog is None and settings.detect:
            from otel_gpu.agent.watchdog import DetectionSettings, Watchdog

            self.watchdog = Watchdog.build(
                detection or DetectionSettings(),
                proc_root=settings.proc_root,
                trainer=trainer,
                phase=phase,
            )
        if (
            self.watchdog is not None
            and settings.stall_diagnosis
            and roots
            and hasattr(self.watchdog, "diagnosis_queue")
        ):
            from otel_gpu.agent.stall_diagnosis import StallDiagnoser
            from otel_gpu.detect.model import STALL

            self.watchdog.diagnosis_queue().register(STALL, StallDiagnoser(roots))
        if self.watchdog is not None:
            self.sampler.add_listener(self.watchdog.on_snapshot)
            if isinstance(self.sampler, SamplerProcess):
                self.sampler.add_listener(self._protect_judged_reads)
            if meter_provider is not None:
                self.watchdog.register_instruments(
                    meter_provider.get_meter("otel_gpu", _version(), schema_url=SCHEMA_URL)
                )

    def _protect_judged_reads(self, _snap: object) -> None:
        """After detection: while any subject is suspected or confirmed (an active condition
        or a breaker not closed), adaptive sampling slows no read the detectors judge."""
        judging = self.watchdog.judging()
        sampler = self.sampler
        if isinstance(sampler, SamplerProcess) and judging != sampler.protected:
            sampler.protect(judging)

    def start(self) -> Agent:
        self.sampler.start()
        return self

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop sampling and flush notifications, both within one ``timeout_s`` bound."""
        from otel_gpu.core.shutdown import close_all

        timeout = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        steps: list[tuple[str, Callable[[float], object]]] = [("sampler", self.sampler.stop)]
        if self.watchdog is not None:
            steps.append(("actions", self.watchdog.close))
        close_all(steps, timeout)


def _version() -> str:
    from otel_gpu import __version__

    return __version__


class BackgroundAgent:
    """An :class:`Agent` built and started on its own thread, so a job that loads the agent
    in-process never reads /proc or NVML on its own threads, not even at start-up."""

    def __init__(self, build: Callable[[], Agent]) -> None:
        self.agent: Agent | None = None
        self._ready = threading.Event()
        threading.Thread(
            target=self._start, args=(build,), name="otel-gpu-agent-start", daemon=True
        ).start()

    def _start(self, build: Callable[[], Agent]) -> None:
        try:
            self.agent = build().start()
        except Exception as exc:  # the job must never be harmed by the agent failing
            log.warning("otel-gpu agent not started: %s", exc)
        finally:
            self._ready.set()

    def wait_started(self, timeout_s: float) -> Agent | None:
        self._ready.wait(timeout_s)
        return self.agent

    def shutdown(self, timeout_s: float = 5.0) -> None:
        agent = self.wait_started(timeout_s)
        if agent is not None:
            agent.shutdown(timeout_s)


def start_in_process(
    meter_provider: MeterProvider,
    settings: Settings | None = None,
    roots: Iterable[int] | None = None,
    trainer: InProcessTrainer | None = None,
    detection: DetectionSettings | None = None,
) -> BackgroundAgent | None:
    """Start the node agent here if this process wins the node lock; never raises.

    Watches the tree under ``roots`` (default: this process, so its DataLoader workers and
    spawned ranks; a torchrun rank passes its parent, torchrun's agent, to cover its sibling
    ranks) and the GPUs named by ``CUDA_VISIBLE_DEVICES``. The engine runs in-process: the
    caller passes the ``trainer`` it belongs to, so detection knows the phase and step and a
    stop action asks the trainer's graceful checkpoint-and-stop first. The agent is built on a
    background thread; the caller keeps the handle to shut it down. ``settings`` and
    ``detection`` default to this process's environment, read here, before the lock.
    """
    try:
        settings = settings or Settings.load()
        if detection is None and settings.detect:
            from otel_gpu.agent.watchdog import DetectionSettings

            detection = DetectionSettings.load()
        if not acquire_node_lock(settings.lock_dir, os.environ.get("CUDA_VISIBLE_DEVICES")):
            return None
    except Exception as exc:
        log.warning("otel-gpu agent not started: %s", exc)
        return None
    chosen = settings
    watched = list(roots) if roots is not None else [os.getpid()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return BackgroundAgent(
        lambda: Agent(
            chosen,
            meter_provider=meter_provider,
            roots=watched,
            visible_devices=visible,
            trainer=trainer,
            detection=detection,
        )
    )
