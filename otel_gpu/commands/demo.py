"""``otel-gpu demo``: the whole product in under a minute, with no GPU and no collector.

A training-like child process runs on a simulated GPU whose memory leaks. The real agent
(sampler, instruments, detection engine, breaker, actions) watches it; a webhook receiver on
127.0.0.1 stands in for Slack. The simulation runs 120x faster than the wall clock, so the
minute shows two hours of a job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from otel_gpu.agent.settings import SIM_SCENARIOS, Settings
from otel_gpu.commands.common import add_command
from otel_gpu.core.child_python import python_argv
from otel_gpu.core.http import BoundedServer
from otel_gpu.core.settings import Setting, add_options, choice, given, number, resolve
from otel_gpu.outputs.run_outputs import RunOutputs
from otel_gpu.outputs.sweeps import labels

if TYPE_CHECKING:
    from otel_gpu.agent.session import AgentInputs

GIB = 1024**3
# A training-like loop: a little CPU work per "step", forever (the demo ends it).
WORKLOAD = (
    "import time\n"
    "step = 0\n"
    "while True:\n"
    "    sum(i * i for i in range(20000))\n"
    "    step += 1\n"
    "    time.sleep(0.05)\n"
)


_IGNORE_SIGINT = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"

# The demo's last line: what to run on a real job.
NEXT = 'next: otel-gpu run -- opentelemetry-instrument python train.py  (README "Watch a job")'


# The demo's own options (flags only: a demo is run by hand).
DEMO_OPTIONS = (
    Setting(
        "scenario", None, choice(SIM_SCENARIOS), "what the simulated GPU does", "leak",
        "--scenario", "SCENARIO",
    ),
    Setting(
        "max_seconds", None,
        number(0, 3600, low_open=True, accepted="use a number of seconds from 1 to 3600"),
        "stop after this many seconds even without an alert", "50", "--max-seconds", "SECONDS",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class DemoOptions:
    """What the demo shows and for how long (:data:`DEMO_OPTIONS`)."""

    scenario: str = "leak"
    max_seconds: float = 50.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "demo",
        "watch a training-like job on a simulated leaking GPU (no GPU needed)",
        """Runs a training-like process on a simulated GPU that leaks memory, watched
        by the real agent: live status, the leak detection, the circuit breaker
        opening and the webhook notification (to a receiver on 127.0.0.1). Finishes
        in under a minute.""",
    )
    add_options(parser, DEMO_OPTIONS)
    parser.set_defaults(func=demo)


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []
    timeout = 5.0  # s per read: a client that stalls is dropped

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with contextlib.suppress(ValueError):
            self.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


def start_receiver() -> tuple[BoundedServer, str]:
    """The demo's stand-in for Slack, on 127.0.0.1 and the project's bounded server: any local
    user can connect to it, and a client that resets or stalls costs no traceback and no
    thread beyond its few slots. Returns the server and its URL."""
    receiver = BoundedServer(("127.0.0.1", 0), _Receiver, 4, "otel-gpu-demo-receiver")
    _Receiver.received = []
    threading.Thread(
        target=receiver.serve_forever, name="otel-gpu-demo-receiver", daemon=True
    ).start()
    return receiver, f"http://127.0.0.1:{receiver.server_address[1]}/alerts"


def demo(args: argparse.Namespace) -> int:
    values, _origin = resolve(DEMO_OPTIONS, env={}, args=given(args, DEMO_OPTIONS))
    opts = DemoOptions(**values)
    from otel_gpu.actions.dispatcher import ActionDispatcher
    from otel_gpu.actions.notifiers import JsonNotifier
    from otel_gpu.agent.session import AgentSession
    from otel_gpu.agent.watchdog import Watchdog
    from otel_gpu.detect.breaker import Breaker, BreakerConfig
    from otel_gpu.detect.engine import DetectConfig, Engine
    from otel_gpu.sampling.sim import SimulatedSource

    out = sys.stdout
    # The demo prints alerts and transitions itself; the actions' log lines would repeat them.
    logging.getLogger("otel_gpu.actions").setLevel(logging.ERROR)
    receiver, url = start_receiver()

    source = SimulatedSource(opts.scenario, time_scale=120.0, leak_bytes_per_s=12 * GIB / 3600)
    watchdog = Watchdog(
        # Shorter leak windows than the defaults (which wait ~2 h of data for a cache to show its
        # cap first): the demo's minute holds only two simulated hours.
        Engine(DetectConfig(leak_bucket_s=15, leak_min_window_s=900, leak_context_s=1800)),
        Breaker(BreakerConfig()),
        dispatcher=ActionDispatcher([JsonNotifier(url)], backoff_s=0.2, source="otel-gpu demo"),
        phase=lambda: source.phase(source.elapsed()),
    )
    workload = DemoWorkload(opts, source, watchdog, url, out)
    reader = InMemoryMetricReader()
    session = AgentSession(
        Settings(interval_s=0.25, exporter="none", detect=False, shutdown_timeout_s=2.0),
        workload,
        resource=lambda: Resource.create({"service.name": "otel-gpu-demo"}),
        # The same live view and summary as `otel-gpu run`, on stderr.
        outputs=lambda: RunOutputs(
            argparse.Namespace(quiet=False, view=False, record=None, summary_json=None),
            f"otel-gpu demo ({opts.scenario}, simulated 120x)",
        ),
        extra_readers=[reader],
    )

    def name(subject: str) -> str:
        """GPU0 51a1a7ed ... rather than the subject's full UUID (the sweep's snapshot is the
        sampler's latest while detection runs on it)."""
        snap = session.agent.sampler.latest if session.agent is not None else None
        return labels(snap).get(subject, subject) if snap is not None else subject

    watchdog.alert_listeners.append(
        lambda a: workload.events.append(f"ALERT {a.kind} on {name(a.subject)}: {a.message}")
    )
    watchdog.transition_listeners.append(
        lambda t: workload.events.append(
            f"BREAKER {name(t.subject)}: {t.from_state} -> {t.to_state}"
        )
    )
    try:
        session.run()
        data = reader.get_metrics_data()
    finally:
        receiver.shutdown()
        receiver.server_close()
    if workload.interrupted.is_set():
        print("\notel-gpu demo: stopped (Ctrl-C)", file=out)
        return 130
    points, names = _count(data)
    print(
        f"\nlast metric collection: {points} data points in {len(names)} instruments "
        f"({', '.join(sorted(n for n in names if n.startswith(('hw.gpu', 'process.gpu'))))}, ...)",
        file=out,
    )
    if _Receiver.received:
        note = _Receiver.received[0]
        keys = ("title", "subject", "from_state", "to_state", "episode")
        summary = {k: note.get(k) for k in keys}
        rate = (note.get("alert") or {}).get("rate_bytes_per_s")
        summary["alert.rate_bytes_per_s"] = rate
        print("notification payload (excerpt):", json.dumps(summary), file=out)
        code = 0
    else:
        print("no alert was raised in this run", file=out)
        code = 0 if opts.scenario == "steady" else 1
    print(NEXT, file=out)
    return code


class DemoWorkload:
    """The demo's job: a training-like child on the simulated GPU, watched until the
    notification was delivered (and two seconds more), ``max_seconds``, or Ctrl-C."""

    name = "a training-like job"
    command: list[str] | None = None
    # Ctrl-C ends the demo cleanly (exit 130) wherever it lands, never with a traceback.
    signals: tuple[int, ...] = (signal.SIGINT,)

    def __init__(self, opts: DemoOptions, source: Any, watchdog: Any, url: str, out: Any) -> None:
        self.opts = opts
        self.source = source
        self.watchdog = watchdog
        self.url = url
        self.out = out
        self.events: list[str] = []  # alerts and transitions, printed by the main thread
        self.interrupted = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None

    def on_signal(self, signum: int) -> None:
        self.interrupted.set()

    def find(self) -> bool:
        return True

    def launch(self) -> AgentInputs | None:
        from otel_gpu.agent.session import AgentInputs

        if self.interrupted.is_set():
            return None
        # The workload ignores Ctrl-C (the terminal sends it to the whole group): the demo
        # stops it.
        self.child = subprocess.Popen(python_argv("-c", _IGNORE_SIGINT + WORKLOAD))
        print(
            f"otel-gpu demo: watching PID {self.child.pid} on a simulated GPU "
            f"({self.opts.scenario}), simulated time runs 120x faster; Ctrl-C to stop.",
            file=self.out,
        )
        print(
            "detection windows shortened for the demo; the defaults need ~2 h of data for a "
            "slow leak",
            file=self.out,
        )
        return AgentInputs(roots=[self.child.pid], source=self.source, watchdog=self.watchdog)

    def agent_failed(self, exc: Exception) -> None:
        raise exc

    def wait(self) -> None:
        started = time.monotonic()
        notified_at: float | None = None
        while time.monotonic() - started < self.opts.max_seconds:
            if self.interrupted.wait(1.0):
                break
            while self.events:
                print(f"  >>> {self.events.pop(0)}", file=self.out)
            if _Receiver.received and notified_at is None:
                notified_at = time.monotonic()
                note = _Receiver.received[0]
                print(
                    f"  >>> NOTIFICATION delivered to {self.url}: {note.get('title')}",
                    file=self.out,
                )
            if notified_at is not None and time.monotonic() - notified_at > 2.0:
                break
        self.out.flush()

    def end(self) -> None:
        if self.child is not None:
            self.child.terminate()
            self.child.wait(5)


def _count(data: Any) -> tuple[int, set[str]]:
    points, names = 0, set[str]()
    if data is None:
        return 0, names
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                names.add(m.name)
                points += len(m.data.data_points)
    return points, names
