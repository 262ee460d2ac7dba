"""What ``run`` / ``watch`` / ``sidecar`` / ``demo`` show and write besides the metrics: the
live view on stderr, the end-of-run summary (``--summary-json``) and the recording
(``--record``). An agent session opens them before the job starts and finishes them after it
(:mod:`otel_gpu.agent.session`)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from otel_gpu.core.errors import UsageError

log = logging.getLogger("otel_gpu.outputs")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """The options :class:`RunOutputs` reads: ``--quiet``, ``--view``, ``--record``,
    ``--summary-json``."""
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no live view and no summary on stderr",
    )
    parser.add_argument(
        "--view",
        action="store_true",
        help="draw the live view even when stderr is not a terminal (default: on a terminal a "
        "table redrawn in place, otherwise one line per interval)",
    )
    parser.add_argument(
        "--record",
        metavar="FILE",
        help="write every sampled point to FILE (CSV; replay it with 'otel-gpu analyze FILE', "
        "plot it with 'otel-gpu report FILE')",
    )
    parser.add_argument(
        "--summary-json",
        metavar="FILE",
        help="write the end-of-run summary to FILE as JSON",
    )


class RunOutputs:
    """The view, summary and recorder of one watched run. Nothing here runs on the job's
    threads or blocks the sampler: the sampler thread hands each sweep over and returns."""

    def __init__(self, args: argparse.Namespace, title: str, *, stream: Any = None) -> None:
        from otel_gpu.outputs.summary import RunSummary
        from otel_gpu.outputs.view import LiveView, choose_mode, make_console

        if args.quiet and args.view:
            raise UsageError("--quiet and --view contradict each other: give one of them")
        self.summary_json: str | None = args.summary_json
        if self.summary_json is not None:
            _check_writable(self.summary_json, "--summary-json")
        self.recorder: Any = None
        if args.record is not None:
            from otel_gpu.outputs.record import Recorder, open_recording

            self.recorder = Recorder(open_recording(args.record), f"--record {args.record}")
        stream = stream if stream is not None else sys.stderr
        is_terminal = bool(getattr(stream, "isatty", lambda: False)())
        self.quiet = bool(args.quiet)
        mode = choose_mode(self.quiet, bool(args.view), is_terminal)
        self.console = make_console(stream, force_terminal=bool(args.view))
        self.view = LiveView(mode, title, console=self.console)
        self.summary = RunSummary()
        self.watchdog: Any = None
        self.sampler: Any = None
        self.leftovers: Any = None
        self.progress: Any = None  # the trainers' progress (agent/trainers.py), when joined
        self._ended = False  # the job has ended: later sweeps are only for its leftovers
        self._started = time.monotonic()

    def attach(self, sampler: Any, watchdog: Any, progress: Any = None) -> None:
        """Listen to an agent's sweeps (before it starts); ``progress``: the trainers' phase
        and step (:class:`otel_gpu.agent.trainers.TrainerProgress`) for the view's title and
        the summary."""
        from otel_gpu.agent.leftovers import LeftoverWatch
        from otel_gpu.outputs.sweeps import labels, on_sweeps

        self.watchdog, self.sampler, self.progress = watchdog, sampler, progress
        self.view.training = None if progress is None else progress.title
        self.view.attach(sampler, watchdog)
        self.leftovers = LeftoverWatch()
        self.leftovers.listeners.append(self._on_leftovers)
        if watchdog is not None:  # after detection, so that its alerts go through the breaker
            on_sweeps(sampler, watchdog, lambda sweep: self.leftovers.on_snapshot(sweep.snapshot))
        else:
            sampler.add_listener(self.leftovers.on_snapshot)
        if watchdog is not None:
            watchdog.alert_listeners.append(self.summary.on_alert)
            watchdog.transition_listeners.append(self.summary.on_transition)

        def summarise(sweep: Any) -> None:
            if self._ended:
                return
            names = labels(sweep.snapshot)
            for subject, point in sweep.points:
                self.summary.observe(subject, point, names.get(subject))
            self.summary.take_trends(sweep.engine)

        # The summary is shown unless --quiet, and written with --summary-json: without either
        # nobody reads it, so its per-sweep bookkeeping is not paid for.
        if not self.quiet or self.summary_json is not None:
            on_sweeps(sampler, watchdog, summarise)
        if self.recorder is not None:
            if watchdog is not None:
                watchdog.alert_listeners.append(self.recorder.on_alert)
            record = self.recorder.on_sweep
            on_sweeps(sampler, watchdog, lambda sweep: None if self._ended else record(sweep))

    def job_exited(self, root: int, timeout_s: float) -> None:
        """The job (its root PID ``root``) has ended: one more sweep looks for the processes it
        started that still hold a GPU (summary and ``orphan`` alerts); bounded by
        ``timeout_s``."""
        if self.leftovers is None:
            return
        # The view, the summary's series and the recording end with the job's last sweep.
        self._ended = True
        self.view.stop()
        self.leftovers.job_exited(root, getattr(self.sampler, "wake", lambda: None), timeout_s)

    def _on_leftovers(self, found: list[Any], snap: Any) -> None:
        """On the sampler thread, after detection: the summary's list, and each leftover as an
        alert through the breaker to the actions (log line, notifications), as any alert."""
        from otel_gpu.agent.leftovers import orphan_alert

        self.summary.leftovers = [f.to_dict() for f in found]
        watchdog = self.watchdog
        if watchdog is None:
            return
        for leftover in found:
            alert = orphan_alert(leftover, snap.time)
            transitions = watchdog.breaker.record_alert(alert)
            for listener in watchdog.alert_listeners:
                listener(alert)
            for t in transitions:
                if watchdog.dispatcher is not None:
                    watchdog.dispatcher.on_transition(t)
                for listener in watchdog.transition_listeners:
                    listener(t)

    def start(
        self, name: str, pid: int, settings: Any, resource: Mapping[str, Any] | None = None
    ) -> None:
        """Start the view with one line saying what is watched and where the metrics go; the
        recording gets the run's context (``resource``: the exported resource's attributes)."""
        self._started = time.monotonic()
        if self.recorder is not None:
            self.recorder.write_context(run_context(settings, resource or {}))
        self.view.start(
            f"otel-gpu: watching {name} (PID {pid}) every {settings.interval_s:g} s, "
            f"{describe_export(settings)}, detection {'on' if self.watchdog is not None else 'off'}"
        )

    def finish(self, exit_code: int | None, command: list[str] | None = None) -> None:
        """After the agent stopped: last frame, recording closed, summary printed and written.

        Never raises: each output fails alone, with one line (a full disk under ``--record``
        still leaves ``--summary-json`` written), and the wrapper exits with the job's code."""
        from otel_gpu.outputs import summary

        with _alone("the live view"):
            self.view.stop()
        if self.recorder is not None:
            from otel_gpu.core.redact import redact_command

            with _alone(self.recorder.name):
                self.recorder.close(
                    ending={
                        "command": redact_command(command) if command else None,
                        "exit_code": exit_code,
                        "ended": _wall_time(),
                        "duration_s": round(time.monotonic() - self._started, 3),
                    }
                )
        data: dict[str, Any] | None = None
        if self.progress is not None:
            with _alone("the trainers' final progress"):
                self.progress.finish()  # the steps they ended after the last poll
        with _alone("the summary"):
            data = self.summary.to_dict(
                duration_s=time.monotonic() - self._started,
                exit_code=exit_code,
                command=command,
                actions=self._actions(),
                training=None if self.progress is None else self.progress.summary(),
            )
        if data is None:
            return
        if not self.quiet:
            # stderr closed or full: nothing to show it on, nor to say so on
            with _alone("the summary"), contextlib.suppress(OSError):
                summary.render(data, self.console)
        if self.summary_json is not None:
            with _alone(f"--summary-json {self.summary_json}"):
                try:
                    summary.write_json(self.summary_json, data)
                except OSError as exc:
                    log.warning(
                        "--summary-json %s: not written (%s)",
                        self.summary_json, exc.strerror or exc,
                    )  # fmt: skip

    def _actions(self) -> dict[str, int]:
        dispatcher = getattr(self.watchdog, "dispatcher", None)
        if dispatcher is None:
            return {}
        stats = dispatcher.stats
        return {
            "notifications_delivered": stats.delivered,
            "notifications_failed": stats.failed,
            "notifications_dropped": stats.dropped + stats.abandoned,
            "stops_requested": stats.stops,
            "stops_refused": stats.stops_refused,
        }


def run_context(settings: Any, resource: Mapping[str, Any]) -> dict[str, Any]:
    """What the report says of a run besides its data: where, which code, when, simulated."""
    from otel_gpu.resource.git import VCS_DIRTY

    return {
        "host": resource.get("host.name") or socket.gethostname(),
        "service": resource.get("service.name"),
        "revision": resource.get("vcs.ref.head.revision"),
        "ref": resource.get("vcs.ref.head.name"),
        "dirty": resource.get(VCS_DIRTY),
        "started": _wall_time(),
        "simulated": getattr(settings, "simulate", None) or None,
    }


def _wall_time() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def _alone(what: str) -> Iterator[None]:
    """One output's end: whatever goes wrong in it is one warning line, never an exception
    that would take the other outputs, or the job's exit code, with it."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the job's exit code must survive any of ours
        log.warning("%s: not finished (%s: %s)", what, type(exc).__name__, exc)


def _check_writable(path: str, flag: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(
            f"{flag} {path}: cannot write there; give a file path in a writable folder"
        )


def describe_export(settings: Any) -> str:
    """Where the metrics go, e.g. ``metrics over OTLP to http://localhost:4317`` (several
    exporters joined with "and"), or ``no metric export``."""
    from otel_gpu.core.otlp import shown_endpoint

    said = []
    for name in settings.exporters:
        if name == "console":
            said.append("metrics printed to stdout as JSON")
        elif name == "prometheus":
            port = os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464")
            said.append(f"metrics served for Prometheus on port {port}")
        elif name == "otlp":
            said.append(f"metrics over OTLP to {shown_endpoint(settings.endpoint)}")
    return " and ".join(said) or "no metric export"
