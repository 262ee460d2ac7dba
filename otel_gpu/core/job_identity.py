"""One ``service.instance.id`` per process, one ``otel_gpu.job.id`` per job.

The semantic conventions ask for one ``service.instance.id`` per process ("we do not recommend
using one identifier for all processes participating in the application"): every rank of a job
then keeps its own Prometheus ``instance`` and ``target_info``, so same-named series of two
ranks never collide in a backend that drops the other resource attributes. Each process gets
its own UUID4 (:func:`instance_id`), unless the user gave one.

The job is carried in its own attribute, ``otel_gpu.job.id``: the fleet gateway routes on it
(``collector-config/otelcol-gateway.yaml``) so a job's series reach one processor replica, and
the processor joins a trainer's ``training.phase`` with the GPUs an agent process beside it
reports when both name the same job. The wrapper (``otel-gpu run``), the instrumented trainer,
its child processes and its forked DataLoader workers all report the same job id.

The job id travels in ``OTEL_RESOURCE_ATTRIBUTES``, the variable every OpenTelemetry SDK reads:
:func:`ensure_job_id` appends ``otel_gpu.job.id=<UUID4>`` there unless one is there already (the
user's always wins; a ``service.instance.id`` the user gave names the job too, as before this
attribute existed). ``otel-gpu run`` does it for the job's environment, and the distro does it
in an instrumented process without a wrapper (the first instrumented process of the job), so
the processes it starts inherit it.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping, MutableMapping, Sequence
from urllib.parse import quote, unquote

from otel_gpu.core.commandline import PYTHON, python_target

RESOURCE_ATTRIBUTES_ENV = "OTEL_RESOURCE_ATTRIBUTES"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
SERVICE_INSTANCE_ID = "service.instance.id"
SERVICE_NAME = "service.name"
JOB_ID = "otel_gpu.job.id"

_lock = threading.Lock()
_process_id: str | None = None


def resource_attributes(env: Mapping[str, str]) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES`` of ``env`` read the way the OpenTelemetry SDK reads it:
    comma-separated ``key=value`` items, values percent-decoded, an item without ``=``
    skipped, and the last of repeated keys kept."""
    attrs: dict[str, str] = {}
    for item in env.get(RESOURCE_ATTRIBUTES_ENV, "").split(","):
        key, sep, value = item.partition("=")
        if sep:
            attrs[key.strip()] = unquote(value.strip())
    return attrs


def given_instance_id(env: Mapping[str, str]) -> str | None:
    """The ``service.instance.id`` the user (or a wrapper) put in ``OTEL_RESOURCE_ATTRIBUTES``,
    or None. An empty value is no id."""
    return resource_attributes(env).get(SERVICE_INSTANCE_ID) or None


def given_service_name(env: Mapping[str, str]) -> str | None:
    """The service name the SDK would take from ``env``: ``OTEL_SERVICE_NAME``, else the
    ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``; None when neither is set."""
    return (
        env.get(SERVICE_NAME_ENV, "").strip() or resource_attributes(env).get(SERVICE_NAME) or None
    )


def given_job_id(env: Mapping[str, str]) -> str | None:
    """The job's id ``env`` names: ``otel_gpu.job.id`` in ``OTEL_RESOURCE_ATTRIBUTES``, else a
    ``service.instance.id`` the user gave there (it named the job before); None if neither."""
    attrs = resource_attributes(env)
    return attrs.get(JOB_ID) or attrs.get(SERVICE_INSTANCE_ID) or None


def job_id(env: Mapping[str, str]) -> str:
    """The job's id: the one ``env`` names, else this process's instance id (a job of one)."""
    return given_job_id(env) or instance_id(env)


def ensure_job_id(env: MutableMapping[str, str]) -> str:
    """The job's id in ``env``, first appended to its ``OTEL_RESOURCE_ATTRIBUTES`` as
    ``otel_gpu.job.id`` when none is there: the ``service.instance.id`` the user gave there,
    else a new UUID4.

    What was there is kept as written, malformed items included: the id is appended after a
    comma (none doubled), percent-encoded as the specification asks of values.
    """
    attrs = resource_attributes(env)
    given = attrs.get(JOB_ID)
    if given:
        return given
    new = attrs.get(SERVICE_INSTANCE_ID) or str(uuid.uuid4())
    existing = env.get(RESOURCE_ATTRIBUTES_ENV, "").rstrip()
    item = f"{JOB_ID}={quote(new, safe='')}"
    if not existing.strip():
        env[RESOURCE_ATTRIBUTES_ENV] = item
    elif existing.endswith(","):
        env[RESOURCE_ATTRIBUTES_ENV] = existing + item
    else:
        env[RESOURCE_ATTRIBUTES_ENV] = f"{existing},{item}"
    return new


def instance_id(env: Mapping[str, str]) -> str:
    """This process's ``service.instance.id``: the one ``env`` gives, else one UUID4 for this
    process, chosen on first use (a child process started with ``env`` chooses its own).

    Not regenerated in a forked child: a DataLoader worker reports nothing of its own.
    """
    given = given_instance_id(env)
    if given is not None:
        return given
    global _process_id
    with _lock:
        if _process_id is None:
            _process_id = str(uuid.uuid4())
        return _process_id


def default_service_name(command: Sequence[str] | None = None) -> str:
    """The service name the environment gives (``OTEL_SERVICE_NAME``, else ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``), else the watched command's program name."""
    name = given_service_name(os.environ)
    if name:
        return name
    return program_name(command or ()) or "otel-gpu"


# Programs that only launch the one that names the job: `opentelemetry-instrument python -u
# train.py` is the job "train", not "opentelemetry-instrument".
_LAUNCHERS = frozenset({"opentelemetry-instrument", "env", "nohup", "time", "exec"})


def program_name(command: Sequence[str]) -> str:
    """The name of the program a command runs, past launchers and the interpreter: the script's
    stem (``train`` for ``python train.py``), the module (``python -m swift.cli.sft``) or the
    program itself (``swift``, ``torchrun``; ``python`` for ``python -c CODE``: code is no name,
    and may hold anything)."""
    words = list(command)
    while words and (os.path.basename(words[0]) in _LAUNCHERS or "=" in words[0]):
        words.pop(0)  # a launcher, or one of env's NAME=value words
        while words and words[0].startswith("-"):
            words.pop(0)  # the launcher's own flags (time -p, env -i)
    if not words:
        return ""
    name = os.path.basename(words[0])
    if PYTHON.match(name):
        return _python_target(name, words[1:])
    return name.removesuffix(".py") or name


def _python_target(interpreter: str, args: Sequence[str]) -> str:
    """What ``interpreter args`` runs: the script's stem, the ``-m`` module, else (``-c``,
    standard input, nothing) the interpreter's own name."""
    kind, value, _ = python_target(args)
    if kind == "module":
        return value or interpreter
    if kind != "script":
        return interpreter
    script = os.path.basename(value)
    return script.removesuffix(".py") or script
