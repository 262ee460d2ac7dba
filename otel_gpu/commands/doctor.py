"""``otel-gpu doctor``: one line per check, ok / warn / fail, each problem with its fix."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from otel_gpu.agent.settings import Settings
from otel_gpu.commands.common import add_command
from otel_gpu.core.errors import UsageError
from otel_gpu.core.printable import printable

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    status: str
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name}: {self.detail}"
        return f"{text} -> {self.fix}" if self.fix and self.status != OK else text


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "doctor",
        "check NVML, GPUs, PID namespaces, git and the exporter endpoint",
        """Checks what the agent needs and prints one line per check: ok, warn or fail,
        with the fix. Exit code 1 when any check fails.""",
    )
    parser.add_argument(
        "--endpoint",
        metavar="URL",
        help="OTLP endpoint to test (default: OTEL_EXPORTER_OTLP_ENDPOINT or http://localhost:4317)",
    )
    parser.add_argument(
        "--simulate", metavar="SCENARIO", help="check against the simulated GPU instead of NVML"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the checks as one JSON document on stdout"
    )
    parser.set_defaults(func=doctor)


def doctor(args: argparse.Namespace) -> int:
    settings = Settings.load(endpoint=args.endpoint, simulate=args.simulate)
    # Every finding is printed as a check line; the agent's own warnings would repeat them.
    logging.getLogger("otel_gpu").setLevel(logging.ERROR)
    failed = False
    checks = []
    for check in run_checks(settings):
        if not args.json:
            print(printable(check.line()), flush=True)  # GPU names are the driver's
        checks.append(check)
        failed = failed or check.status == FAIL
    if args.json:
        doc = {"ok": not failed, "checks": [asdict(c) for c in checks]}
        print(json.dumps(doc, indent=2))
    sys.stdout.flush()
    return 1 if failed else 0


def run_checks(settings: Settings) -> Iterator[Check]:
    yield from _guard("gpu", lambda: _gpu_checks(settings))
    yield from _guard("git", _git_check)
    yield from _guard("node lock", lambda: _lock_checks(settings))
    yield from _guard("exporter", lambda: iter([_endpoint_check(settings)]))


def _lock_checks(settings: Settings) -> Iterator[Check]:
    """Who samples this user's GPUs now: the holder of each node lock (one per GPU set)."""
    from otel_gpu.agent.node_lock import LOCK_PREFIX, holder, lock_directory

    directory = lock_directory(settings.lock_dir)
    try:
        names = sorted(
            n for n in os.listdir(directory) if n.startswith(LOCK_PREFIX) and n.endswith(".lock")
        )
    except OSError as exc:
        yield Check(WARN, "node lock", f"cannot list {directory}: {exc.strerror or exc}")
        return
    held = False
    for name in names:
        found = holder(os.path.join(directory, name))
        if found is None:
            continue
        held = True
        gpus = name.removeprefix(f"{LOCK_PREFIX}-").removesuffix(".lock")
        which = "all GPUs" if name == f"{LOCK_PREFIX}.lock" else f"GPUs {gpus}"
        yield Check(
            OK,
            "node lock",
            f"{which} sampled by PID {found[0]} ({found[1]}); other instrumented jobs of "
            f"yours on them export their own spans and training metrics ({directory}/{name})",
        )
    if not held:
        yield Check(
            OK, "node lock", f"free: the next instrumented job samples its GPUs ({directory})"
        )


def _guard(name: str, checks: Callable[[], Iterator[Check]]) -> Iterator[Check]:
    try:
        yield from checks()
    except UsageError:
        raise
    except Exception as exc:  # a broken check is reported, never a traceback
        yield Check(FAIL, name, f"check crashed: {type(exc).__name__}: {exc}", "report this bug")


def _gpu_checks(settings: Settings) -> Iterator[Check]:
    from otel_gpu.agent.agent import make_source
    from otel_gpu.sampling.procs import ProcessTree

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    source = make_source(settings, visible)
    try:
        reading = source.sample([os.getpid()])
        info = source.host_info()
    finally:
        source.close()
    if reading.no_gpu_reason:
        yield Check(
            FAIL,
            "nvml",
            reading.no_gpu_reason,
            "install the NVIDIA driver (libnvidia-ml.so.1), run the container with the NVIDIA "
            "runtime, set OTEL_GPU_NVML_LIBRARY to the library's path, or use --simulate",
        )
        yield _namespace_check(settings)
        return
    driver = info.driver_version or "unknown"
    cuda = info.cuda_driver_version or "unknown"
    yield Check(OK, "nvml", f"driver {driver}, CUDA driver {cuda}")
    if not reading.gpus:
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        yield Check(
            FAIL, "gpus", f"no GPU visible{hint}", "check CUDA_VISIBLE_DEVICES and the driver"
        )
        return
    for g in reading.gpus:
        mem = (
            f"{g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:.1f} GiB"
            if g.memory_used is not None and g.memory_total
            else "memory unknown"
        )
        status = OK if g.status == "ok" else FAIL
        yield Check(
            status,
            f"gpu {g.index} mig" if g.parent else f"gpu {g.index}",
            f"{g.name or 'unknown'} {g.uuid}, {mem}, status {g.status}",
            "check `nvidia-smi`; a lost GPU needs a reset or a reboot",
        )
    pids = sorted({gp.pid for gp in reading.gpu_processes})
    tree = ProcessTree([], proc_root=settings.proc_root)
    mapped = tree.sample(pids)
    if not pids:
        yield Check(OK, "gpu processes", "none running")
        yield _namespace_check(settings)
    elif mapped.unmapped_gpu_pids:
        yield Check(
            WARN,
            "pid namespace",
            f"{len(mapped.unmapped_gpu_pids)} of {len(pids)} GPU processes are not visible from "
            "here (NVML reports host PIDs); their GPU memory is reported under the host PID",
            "run with the host PID namespace (docker --pid=host, Kubernetes hostPID: true) or "
            "mount the host's /proc and set OTEL_GPU_PROC_ROOT to it",
        )
    else:
        yield Check(OK, "pid namespace", f"all {len(pids)} GPU processes visible")


def _namespace_check(settings: Settings) -> Check:
    """Without GPU processes to map, whether the PIDs NVML reports would be visible here:
    NVML reports host PIDs, which a process in a container's PID namespace cannot see."""
    from otel_gpu.sampling.procfs import read_status

    levels = read_status("/proc", os.getpid())[1]
    if settings.proc_root != "/proc":
        return Check(OK, "pid namespace", f"host processes read from {settings.proc_root}")
    if len(levels) > 1:
        return Check(
            WARN,
            "pid namespace",
            f"this process is in a nested PID namespace (PID {levels[-1]} here, {levels[0]} on "
            "the host): GPU processes NVML reports will not be visible",
            "run with the host PID namespace (docker --pid=host, Kubernetes hostPID: true) or "
            "mount the host's /proc and set OTEL_GPU_PROC_ROOT to it",
        )
    if not levels:
        return Check(WARN, "pid namespace", "unknown (no NSpid in /proc/self/status)")
    return Check(OK, "pid namespace", "host PID namespace: NVML's PIDs are visible")


def _git_check() -> Iterator[Check]:
    from otel_gpu.resource import GitResourceDetector

    attrs = dict(GitResourceDetector().detect().attributes)
    rev = attrs.get("vcs.ref.head.revision")
    if not rev:
        yield Check(
            WARN,
            "git",
            f"{os.getcwd()} is not in a git repository: no vcs.* provenance",
            "run from the training code's repository or set OTEL_GPU_GIT_DIR",
        )
        return
    url = attrs.get("vcs.repository.url.full", "no remote")
    name = attrs.get("vcs.ref.head.name", "detached")
    yield Check(OK, "git", f"{url} {name} @ {str(rev)[:12]}")


def _endpoint_check(settings: Settings) -> Check:
    """A real OTLP handshake: an empty metrics Export, so a port that merely accepts TCP (a
    plain HTTP server, another service) is not reported as a collector."""
    endpoint = settings.endpoint or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317"
    )
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    host, port = parts.hostname or "localhost", parts.port or 4317
    where = f"{host}:{port}"
    fix = (
        "start a collector there (OTel Collector, rotel, `otel-gpu processor`) or set "
        "OTEL_EXPORTER_OTLP_ENDPOINT / --endpoint"
    )
    try:
        with socket.create_connection((host, port), timeout=_HANDSHAKE_S):
            pass
    except TimeoutError:
        return Check(FAIL, "exporter", f"{where}: timed out connecting", fix)
    except OSError as exc:
        return Check(FAIL, "exporter", f"{where}: refused ({exc.strerror or exc})", fix)
    answer, code = otlp_handshake(where, tls=parts.scheme == "https")
    if code is None:
        return Check(OK, "exporter", f"{where}: OTLP ok ({answer})")
    if code == "UNAUTHENTICATED":
        return Check(
            WARN,
            "exporter",
            f"{where}: an OTLP server that wants credentials ({answer})",
            "set OTEL_EXPORTER_OTLP_HEADERS (e.g. authorization=Bearer%20TOKEN)",
        )
    if code == "DEADLINE_EXCEEDED":
        return Check(FAIL, "exporter", f"{where}: timed out (no OTLP answer in "
                     f"{_HANDSHAKE_S:g} s)", fix)  # fmt: skip
    return Check(FAIL, "exporter", f"{where}: not an OTLP gRPC server ({answer})", fix)


_HANDSHAKE_S = 2.0  # deadline of the doctor's connection and handshake, seconds
_METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def otlp_handshake(target: str, tls: bool = False) -> tuple[str, str | None]:
    """Send an empty ExportMetricsServiceRequest (zero bytes on the wire) to ``target``.

    (what answered, None) on success, else (the error detail, the gRPC status name)."""
    import grpc

    channel = (
        grpc.secure_channel(target, grpc.ssl_channel_credentials())
        if tls
        else grpc.insecure_channel(target)
    )
    try:
        call = channel.unary_unary(
            _METRICS_EXPORT, request_serializer=bytes, response_deserializer=bytes
        )
        call(b"", timeout=_HANDSHAKE_S)
        return "an empty metrics Export was accepted", None
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        name = code.name if code is not None else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else ""
        # gRPC's detail repeats the address before the cause; keep the cause.
        cause = (details or "").rsplit(f"{target}: ", 1)[-1].strip()
        return f"{name}: {cause[:160]}", name
    finally:
        channel.close()
