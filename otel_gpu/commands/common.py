"""Options and plumbing shared by the agent subcommands (run, watch, sidecar, demo)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource

from otel_gpu.agent.settings import AGENT_OPTIONS, DECLARED, ENV, Settings
from otel_gpu.core.settings import add_options, given


def add_command(
    sub: argparse._SubParsersAction, name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: ``summary`` is its line in ``otel-gpu --help``,
    ``description`` (a triple-quoted paragraph, re-flowed by argparse) heads its own ``--help``."""
    return sub.add_parser(name, help=summary, description=" ".join(description.split()))


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """Options every watching command takes, built from the settings' declarations. Unset
    options fall back to the environment."""
    add_options(parser, AGENT_OPTIONS)
    parser.add_argument(
        "--service-name",
        metavar="NAME",
        help="service.name of the exported resource, which `run` gives the job too (env "
        "OTEL_SERVICE_NAME; default: service.name in OTEL_RESOURCE_ATTRIBUTES, else the program past launchers: train for python train.py)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the agent's own activity")


def settings_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, **defaults: object
) -> Settings:
    """The agent's settings: the command's options > ``env`` (default: this process's) >
    ``defaults`` a command has of its own (the sidecar's) > the declared defaults."""
    env = os.environ if env is None else env
    explicit = given(args, DECLARED)
    for name, value in defaults.items():
        if explicit.get(name) is None and not env.get(ENV[name] or "", "").strip():
            explicit[name] = value
    return Settings.load(env, **explicit)


# Every command's log lines look alike.
LOG_FORMAT = "otel-gpu: %(levelname)s %(name)s: %(message)s"


def setup_logging(verbose: bool) -> None:
    from otel_gpu.core.printable import PrintableFormatter

    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(PrintableFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


def build_resource(
    service_name: str | None,
    command: Sequence[str] | None = None,
    settings: Settings | None = None,
    env: Mapping[str, str] | None = None,
) -> Resource:
    """Service, host, git provenance, GPU host and job context (each detector is bounded and
    never raises): the detectors the distro gives an instrumented process, so the job's
    processes name the same service, host and job (``service.instance.id`` from ``env``, the
    job's environment; default: this process's). The GPU host detector reads the same GPU
    source the agent will (NVML or simulated). Command-line attributes (the SDK's process
    detector) follow ``process_command``."""
    from opentelemetry.sdk.resources import ResourceDetector, get_aggregated_resources

    from otel_gpu.core.job_identity import default_service_name
    from otel_gpu.core.redact import COMMAND_REDACTED
    from otel_gpu.core.redact_sdk import redact_resource
    from otel_gpu.resource import GitResourceDetector, GpuHostResourceDetector, JobResourceDetector
    from otel_gpu.resource.host import host_info_source

    detectors: list[ResourceDetector] = [
        *_sdk_detectors("host"),
        GitResourceDetector(),
        JobResourceDetector(env=env),
    ]
    if settings is not None:
        chosen = settings
        detectors.append(
            GpuHostResourceDetector(
                source_factory=lambda: host_info_source(chosen.simulate, chosen.nvml_library)
            )
        )
    name = service_name or default_service_name(command)
    base = Resource.create({SERVICE_NAME: name})
    resource = get_aggregated_resources(detectors, initial_resource=base, timeout=5)
    mode = settings.process_command if settings is not None else COMMAND_REDACTED
    return redact_resource(resource, mode)


def _sdk_detectors(*names: str) -> list[Any]:
    """The SDK's resource detectors registered under ``names`` (entry points, as
    ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS`` selects them); one missing from this SDK is left
    out."""
    from importlib.metadata import entry_points

    found = []
    for name in names:
        for entry in entry_points(group="opentelemetry_resource_detector", name=name):
            try:
                found.append(entry.load()())
            except Exception as exc:  # a broken installation must not stop the command
                logging.getLogger("otel_gpu.resource").warning(
                    "resource detector %r not loaded: %s", name, exc
                )
            break
    return found


# Variables otel-gpu put into its own environment, which a launched job must not inherit.
ADDED_ENV: set[str] = set()


def quiet_grpc() -> None:
    """Keep gRPC's C core from printing its own log lines (``E1201 ... add_port.cc``) beside
    ours, unless the user asked for them with ``GRPC_VERBOSITY``. Must run before grpc is
    imported (it reads the variable once)."""
    if "GRPC_VERBOSITY" not in os.environ:
        os.environ["GRPC_VERBOSITY"] = "NONE"
        ADDED_ENV.add("GRPC_VERBOSITY")


def job_environment() -> dict[str, str]:
    """The environment a launched job gets: the user's, without what otel-gpu added."""
    return {k: v for k, v in os.environ.items() if k not in ADDED_ENV}
