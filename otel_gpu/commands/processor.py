"""``otel-gpu processor``: run the OTLP processor service until SIGTERM/SIGINT.

Each option falls back to an ``OTEL_GPU_PROCESSOR_*`` variable, then to its default:
LISTEN, FORWARD (comma-separated), STATE, TOKEN, HEALTH, PROMETHEUS, TLS_CERT, TLS_KEY,
QUEUE_DIR.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from otel_gpu.commands.common import LOG_FORMAT
from otel_gpu.errors import UsageError

_ENV = "OTEL_GPU_PROCESSOR_"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "processor",
        help="OTLP gRPC processor: forwards everything, detects leaks/stalls fleet-wide",
        description="Receive OTLP metrics, traces and logs over gRPC, forward them unchanged to "
        "the --forward endpoints, run leak/stall detection on the GPU series, and send alerts "
        "(log records) and detector metrics downstream. Notification settings: OTEL_GPU_* "
        "webhook variables (see the README); breaker settings: OTEL_GPU_BREAKER_*.",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="gRPC address to serve (env OTEL_GPU_PROCESSOR_LISTEN, default 127.0.0.1:4317; "
        "containers pass 0.0.0.0:4317)",
    )
    parser.add_argument(
        "--forward",
        action="append",
        metavar="HOST:PORT",
        help="downstream OTLP gRPC endpoint, repeatable; https://HOST:PORT for TLS "
        "(env OTEL_GPU_PROCESSOR_FORWARD, comma-separated; default: none)",
    )
    parser.add_argument(
        "--state",
        metavar="FILE",
        help="SQLite file keeping breaker state and alert history across restarts "
        "(env OTEL_GPU_PROCESSOR_STATE; default: memory only)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument(
        "--token",
        help="require 'authorization: Bearer TOKEN' (prefer env OTEL_GPU_PROCESSOR_TOKEN: "
        "arguments are visible in ps)",
    )
    parser.add_argument(
        "--health",
        metavar="HOST:PORT",
        help="serve HTTP /healthz and /stats here (env OTEL_GPU_PROCESSOR_HEALTH; default off)",
    )
    parser.add_argument(
        "--prometheus",
        metavar="HOST:PORT",
        help="serve the detector metrics and the processor's own metrics as Prometheus "
        "/metrics here (env OTEL_GPU_PROCESSOR_PROMETHEUS; default off)",
    )
    parser.add_argument(
        "--stall-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="/healthz fails when no request was accepted for this long after the first one "
        "(default 300)",
    )
    parser.add_argument(
        "--max-series",
        type=int,
        default=20_000,
        metavar="N",
        help="detection subjects tracked at once (default 20000)",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=16,
        metavar="N",
        help="concurrent requests before pushing back with RESOURCE_EXHAUSTED (default 16)",
    )
    parser.add_argument(
        "--max-requests-per-s",
        type=float,
        default=0.0,
        metavar="R",
        help="admission rate over all signals; 0 = unlimited (default)",
    )
    parser.add_argument(
        "--retry-after",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="retry delay sent with a push-back (default 1)",
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=2048,
        metavar="N",
        help="requests queued per downstream before dropping (default 2048)",
    )
    parser.add_argument(
        "--export-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often detector metrics are sent (default 10)",
    )
    parser.add_argument(
        "--flush-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="bound on the flush at shutdown (default 5)",
    )
    parser.add_argument(
        "--queue-dir",
        metavar="DIR",
        help="keep each downstream's forward queue on disk here: data accepted during an outage "
        "survives a restart (even kill -9) and is sent later (env OTEL_GPU_PROCESSOR_QUEUE_DIR; "
        "default: in memory)",
    )
    parser.add_argument(
        "--queue-dir-mib",
        type=int,
        default=1024,
        metavar="MIB",
        help="disk queue size per downstream; beyond it exports are refused (default 1024)",
    )
    parser.add_argument(
        "--memory-limit-mib",
        type=int,
        default=1024,
        metavar="MIB",
        help="resident memory limit; above 80%% of it exports are refused with "
        "RESOURCE_EXHAUSTED and a retry delay; 0 = off (default 1024)",
    )
    parser.add_argument(
        "--max-recv-mib",
        type=float,
        default=4.0,
        metavar="MIB",
        help="largest export request accepted, after decompression (default 4, as the Collector)",
    )
    parser.add_argument(
        "--max-series-per-reporter",
        type=int,
        default=2_000,
        metavar="N",
        help="detection subjects one reporter (resource identity) may hold (default 2000)",
    )
    parser.add_argument(
        "--telemetry-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often the processor's own metrics are sent downstream; 0 = never (default 30)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.set_defaults(func=run_processor)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """Build a ProcessorConfig: argument > OTEL_GPU_PROCESSOR_* > default."""
    from otel_gpu.processor.config import Downstream, ProcessorConfig

    env = os.environ if environ is None else environ

    def pick(value: str | None, name: str) -> str | None:
        if value is not None:
            return value
        raw = env.get(_ENV + name, "").strip()
        return raw or None

    forward = args.forward
    if forward is None:
        raw = env.get(_ENV + "FORWARD", "")
        forward = [x for x in raw.split(",") if x.strip()]
    token = pick(args.token, "TOKEN")
    return ProcessorConfig(
        listen=pick(args.listen, "LISTEN") or "127.0.0.1:4317",
        forward=tuple(Downstream.parse(x) for x in forward),
        state_path=pick(args.state, "STATE"),
        tls_cert=pick(args.tls_cert, "TLS_CERT"),
        tls_key=pick(args.tls_key, "TLS_KEY"),
        token=token,
        health=pick(args.health, "HEALTH"),
        prometheus=pick(args.prometheus, "PROMETHEUS"),
        stall_after_s=args.stall_after,
        max_series=args.max_series,
        max_inflight=args.max_inflight,
        max_requests_per_s=args.max_requests_per_s,
        retry_after_s=args.retry_after,
        queue_requests=args.queue_size,
        export_interval_s=args.export_interval,
        flush_timeout_s=args.flush_timeout,
        queue_dir=pick(args.queue_dir, "QUEUE_DIR"),
        queue_dir_bytes=args.queue_dir_mib * 1024 * 1024,
        memory_limit_mib=args.memory_limit_mib,
        max_recv_bytes=int(args.max_recv_mib * 1024 * 1024),
        max_series_per_reporter=args.max_series_per_reporter,
        telemetry_interval_s=args.telemetry_interval,
    )


def run_processor(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    # grpc and urllib3 debug output could echo request metadata (the token): keep them quiet.
    logging.getLogger("grpc").setLevel(logging.WARNING)

    from otel_gpu.actions.config import ActionsConfig
    from otel_gpu.actions.dispatcher import ActionDispatcher
    from otel_gpu.detect.breaker import BreakerConfig
    from otel_gpu.detect.config import DetectConfig
    from otel_gpu.detect.engine import Engine
    from otel_gpu.processor.scrape import ProcessorScrape
    from otel_gpu.processor.server import Processor

    actions_config = ActionsConfig.from_env()
    actions = ActionDispatcher.from_config(actions_config, source="otel-gpu processor")
    scrape = None
    if config.prometheus:
        # Bound before anything is served: a taken port ends the command here (exit 2).
        setting = "--prometheus" if args.prometheus else _ENV + "PROMETHEUS"
        scrape = ProcessorScrape(config.prometheus, setting, config.max_series)
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


__all__ = ["add_parser", "config_from_args", "run_processor", "UsageError"]
