"""``otel-gpu processor``: run the OTLP processor service until SIGTERM/SIGINT.

Its options and their ``--help`` come from the declarations in
:data:`otel_gpu.processor.settings.DECLARED`; each falls back to its ``OTEL_GPU_PROCESSOR_*``
variable where it has one, then to its default.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping

from otel_gpu.commands.common import LOG_FORMAT, add_command
from otel_gpu.core.settings import add_options, given
from otel_gpu.processor.settings import DECLARED, ProcessorConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "processor",
        "OTLP gRPC processor: forwards everything, detects leaks/stalls fleet-wide",
        """Receive OTLP metrics, traces and logs over gRPC, forward them unchanged to
        the --forward endpoints, run leak/stall detection on the GPU series, and
        send alerts (log records) and detector metrics downstream. Notification
        settings: OTEL_GPU_* webhook variables (see docs/detection.md); breaker settings:
        OTEL_GPU_BREAKER_*.""",
    )
    add_options(parser, DECLARED)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.set_defaults(func=run_processor)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ProcessorConfig:
    """The processor's settings: its options > ``OTEL_GPU_PROCESSOR_*`` (``environ``, default
    this process's) > the declared defaults."""
    return ProcessorConfig.load(os.environ if environ is None else environ, **given(args, DECLARED))


def run_processor(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from otel_gpu.core.printable import PrintableFormatter

    handler = logging.StreamHandler(sys.stderr)
    # Subjects and messages carry what remote reporters sent: no escape reaches the terminal.
    handler.setFormatter(PrintableFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    # grpc and urllib3 debug output could echo request metadata (the token): keep them quiet.
    logging.getLogger("grpc").setLevel(logging.WARNING)

    from otel_gpu.actions.dispatcher import ActionDispatcher
    from otel_gpu.actions.settings import ActionsConfig
    from otel_gpu.detect.breaker import BreakerConfig
    from otel_gpu.detect.engine import Engine
    from otel_gpu.detect.settings import DetectConfig
    from otel_gpu.processor.scrape import ProcessorScrape
    from otel_gpu.processor.server import Processor

    actions_config = ActionsConfig.from_env()
    actions = ActionDispatcher.from_config(actions_config, source="otel-gpu processor")
    scrape = None
    if config.prometheus:
        # Bound before anything is served: a taken port ends the command here (exit 2).
        scrape = ProcessorScrape(config.prometheus, config.source("prometheus"), config.max_series)
    processor = Processor(
        config,
        engine=Engine(DetectConfig.from_env()),
        breaker_config=BreakerConfig.from_env(),
        actions=actions,
        scrape=scrape,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        processor.start()
        where = [f"listening on {processor.address}" + (" (TLS)" if config.tls_cert else "")]
        if processor.health_address:
            where.append(f"health on http://{processor.health_address}/healthz")
        if scrape is not None:
            where.append(f"Prometheus metrics on http://{scrape.address}/metrics")
        where.append(
            "forwarding to " + ", ".join(d.target for d in config.forward)
            if config.forward
            else "not forwarding"
        )
        where.append(f"state in {config.state_path}" if config.state_path else "state in memory")
        if config.queue_dir:
            where.append(f"forward queues in {config.queue_dir}")
        for line in actions_config.describe():
            where.append(f"notifying {line}")
        print("otel-gpu processor: " + "; ".join(where), file=sys.stderr, flush=True)
        stop.wait()
        print("otel-gpu processor: stopping", file=sys.stderr, flush=True)
    finally:
        processor.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


__all__ = ["add_parser", "config_from_args", "run_processor"]
