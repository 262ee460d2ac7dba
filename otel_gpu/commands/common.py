"""Options and plumbing shared by the agent subcommands (run, watch, demo)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from opentelemetry.sdk.resources import SERVICE_NAME, Resource

from otel_gpu.config import SIM_SCENARIOS, Settings


def add_agent_options(
    parser: argparse.ArgumentParser, *, exporter_default: str | None = None
) -> None:
    """Options every watching command takes. Unset options fall back to the environment."""
    parser.add_argument(
        "--interval",
        type=float,
        metavar="SECONDS",
        help="sampling period in seconds, 0.1 or more (env OTEL_GPU_INTERVAL, default 5)",
    )
    parser.add_argument(
        "--exporter",
        metavar="NAMES",
        default=exporter_default,
        help="where metrics go, comma-separated: otlp (gRPC, OTEL_EXPORTER_OTLP_* settings), "
        "console, prometheus (GET /metrics on OTEL_EXPORTER_PROMETHEUS_HOST:PORT, default "
        "localhost:9464); or none (env OTEL_METRICS_EXPORTER, default otlp)",
    )
    parser.add_argument(
        "--endpoint",
        metavar="URL",
        help="OTLP gRPC endpoint, e.g. http://localhost:4317 (env OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--export-interval",
        type=float,
        metavar="SECONDS",
        help="metric export period in seconds (env OTEL_METRIC_EXPORT_INTERVAL in ms, default 10 s)",
    )
    parser.add_argument(
        "--simulate",
        metavar="SCENARIO",
        help=f"use a simulated GPU instead of NVML: {', '.join(SIM_SCENARIOS)} (env OTEL_GPU_SIMULATE)",
    )
    parser.add_argument(
        "--no-detect",
        action="store_true",
        help="do not run leak/stall detection in the agent (env OTEL_GPU_DETECT=false)",
    )
    parser.add_argument(
        "--service-name",
        metavar="NAME",
        help="service.name of the exported resource (env OTEL_SERVICE_NAME; default: the program)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the agent's own activity")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings.load(
        interval_s=args.interval,
        exporter=args.exporter,
        endpoint=args.endpoint,
        export_interval_s=args.export_interval,
        simulate=args.simulate,
        detect=False if args.no_detect else None,
    )


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="otel-gpu: %(levelname)s %(name)s: %(message)s",
    )


def build_resource(
    service_name: str | None, command: Sequence[str] | None = None, settings: Settings | None = None
) -> Resource:
    """Service, git provenance, GPU host and job context (each detector is bounded and never
    raises). The host detector reads the same GPU source the agent will (NVML or simulated)."""
    from opentelemetry.sdk.resources import ResourceDetector, get_aggregated_resources

    from otel_gpu.agent import make_source
    from otel_gpu.export import default_service_name
    from otel_gpu.resource import GitResourceDetector, GpuHostResourceDetector, JobResourceDetector

    detectors: list[ResourceDetector] = [GitResourceDetector(), JobResourceDetector()]
    if settings is not None:
        detectors.append(GpuHostResourceDetector(source_factory=lambda: make_source(settings)))
    name = service_name or default_service_name(command)
    base = Resource.create({SERVICE_NAME: name})
    return get_aggregated_resources(detectors, initial_resource=base, timeout=5)
