"""One ``service.instance.id`` per process and one ``otel_gpu.job.id`` per job, shared by its
processes, so the fleet gateway keeps a job on one processor replica and the processor joins the
trainer's phase with the wrapper's GPUs (issue 22.1).

Real processes: ``otel-gpu run`` around an ``opentelemetry-instrument``-ed trainer (which also
forks a worker, as a DataLoader does), both exporting over the SDK's OTLP gRPC exporter to a
receiver on 127.0.0.1; the processor's own decoder reads the exported requests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import CLI, clean_env
from support.otlp_sink import OtlpSink, attrs

from otel_gpu.commands.run import shared_identity
from otel_gpu.core.job_identity import (
    RESOURCE_ATTRIBUTES_ENV,
    SERVICE_NAME_ENV,
    default_service_name,
    ensure_job_id,
    given_service_name,
    resource_attributes,
)
from otel_gpu.processor.decode import resource_info

ROOT = Path(__file__).resolve().parents[1]
INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")
GATEWAY = ROOT / "collector-config" / "otelcol-gateway.yaml"

# The OpenTelemetry SDK's own reading of OTEL_RESOURCE_ATTRIBUTES, for each value on stdin.
_SDK_READS = """
import json, os, sys
from opentelemetry.sdk.resources import OTELResourceDetector
out = []
for raw in json.load(sys.stdin):
    os.environ.pop("OTEL_RESOURCE_ATTRIBUTES", None)
    if raw is not None:
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = raw
    out.append(dict(OTELResourceDetector().detect().attributes))
print(json.dumps(out))
"""

ID = "service.instance.id"
JOB = "otel_gpu.job.id"

# (OTEL_RESOURCE_ATTRIBUTES as the user set it, the id they gave)
GIVEN = [
    (None, None),
    ("", None),
    ("  ", None),
    ("team=ml", None),
    ("team=ml,", None),
    ("team=ml, ", None),
    ("oops,team=ml", None),  # a malformed item stays as it was: the SDK skips it, as before
    ("team=a%2Cb", None),  # an encoded comma stays encoded
    (f"{ID}=", None),  # an empty value is no id
    (f"{JOB}=mine", "mine"),
    (f"team=ml, {JOB} = sft%2Frun-7", "sft/run-7"),  # spaces and percent-encoding, as the SDK
]


def _sdk_reads(values: list[str | None]) -> list[dict[str, str]]:
    res = subprocess.run(
        [sys.executable, "-c", _SDK_READS], input=json.dumps(values),
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


@pytest.mark.process
def test_the_id_is_added_to_what_the_user_set_and_theirs_is_kept() -> None:
    after: list[str | None] = []
    ids = []
    for raw, given in GIVEN:
        env = {} if raw is None else {RESOURCE_ATTRIBUTES_ENV: raw}
        ids.append(ensure_job_id(env))
        after.append(env[RESOURCE_ATTRIBUTES_ENV])
        if given is not None:
            assert ids[-1] == given and after[-1] == raw  # untouched
        else:
            assert uuid.UUID(ids[-1]).version == 4
            assert after[-1].startswith((raw or "").rstrip())  # what was there, as written
    sdk_before = _sdk_reads([raw for raw, _ in GIVEN])
    sdk_after = _sdk_reads(after)
    for (raw, _given), before, now, new_id in zip(GIVEN, sdk_before, sdk_after, ids, strict=True):
        # The SDK reads the same attributes, with the job's id.
        assert now == {**before, JOB: new_id}, raw
        # And this module reads OTEL_RESOURCE_ATTRIBUTES as the SDK does.
        assert resource_attributes({RESOURCE_ATTRIBUTES_ENV: raw or ""}) == before, raw
    assert len(set(ids)) == len(ids)  # a new id each time, or the one given


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "wrapper_name", "sdk_name", "job_name"),
    [
        ({}, "python", None, "python"),  # the job gets the wrapper's default name
        ({SERVICE_NAME_ENV: "sft"}, "sft", "sft", "sft"),
        ({RESOURCE_ATTRIBUTES_ENV: "service.name=sft%20a"}, "sft a", "sft a", None),  # kept
        ({SERVICE_NAME_ENV: "x", RESOURCE_ATTRIBUTES_ENV: "service.name=y"}, "x", "x", "x"),
        ({SERVICE_NAME_ENV: "x"}, "flag", "x", "flag"),  # --service-name names both
    ],
)
def test_the_job_is_given_the_wrappers_service_name_unless_it_has_the_same(
    env: dict[str, str], wrapper_name: str, sdk_name: str | None, job_name: str | None
) -> None:
    assert given_service_name(env) == sdk_name  # OTEL_SERVICE_NAME first, as the SDK
    job = shared_identity(dict(env), wrapper_name)
    assert job.get(SERVICE_NAME_ENV) == job_name
    assert given_service_name(job) == wrapper_name


@pytest.mark.unit
@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["python", "train.py"], "train"),
        (["opentelemetry-instrument", "python3.11", "-u", "/src/train.py", "--lr", "1"], "train"),
        (["env", "RANK=0", "python", "-m", "swift.cli.sft"], "swift.cli.sft"),
        (["swift", "sft", "--model", "m"], "swift"),
        (["/usr/bin/torchrun", "--nproc-per-node", "2", "train.py"], "torchrun"),
        (["python3"], "python3"),  # nothing past the interpreter: its own name
        (["python", "-W", "ignore", "train.py"], "train"),  # an option's value is no script
        (["python3", "-X", "importtime", "-Wignore", "train.py"], "train"),
        (["python", "-um", "swift.cli.sft"], "swift.cli.sft"),
        (["python", "-msweep"], "sweep"),
        (["python", "-c", "import os; T='s3cr3t'"], "python"),  # code is no name (nor shown)
        (["python", "-c", "print(1)"], "python"),
        (["time", "-p", "python", "train.py"], "train"),  # a launcher's own flags
        (["env", "-i", "RANK=0", "python", "train.py"], "train"),
        ([], "otel-gpu"),
    ],
)
def test_the_default_service_name_is_the_program_past_launchers(
    command: list[str], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SERVICE_NAME_ENV, raising=False)
    monkeypatch.delenv(RESOURCE_ATTRIBUTES_ENV, raising=False)
    assert default_service_name(command) == name


# -- otel-gpu run around an instrumented trainer -----------------------------------------------

TRAINER = """
import os, sys, time
import otel_gpu
from opentelemetry import trace
print(os.environ["OTEL_RESOURCE_ATTRIBUTES"], flush=True)
otel_gpu.step(1)
with otel_gpu.phase("train"):
    trace.get_tracer("job").start_span("probe").end()
    worker = os.fork()  # what a DataLoader worker is: the trainer's providers, forked
    if worker == 0:
        resource = trace.get_tracer_provider().resource.attributes
        with open(sys.argv[1], "w") as f:
            f.write(resource["otel_gpu.job.id"] + " " + resource["service.instance.id"])
        os._exit(0)
    os.waitpid(worker, 0)
    time.sleep(2.0)  # training.phase / training.step exported a few times
"""


def _run(
    sink: OtlpSink, tmp_path: Path, *job: str, options: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "run", "--simulate", "steady", "--no-detect", "--interval", "0.2",
         "--export-interval", "0.5", *options, "--", *job],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_METRIC_EXPORT_INTERVAL="500", OTEL_GPU_LOCK_DIR=str(tmp_path),
            PYTHONPATH=str(ROOT), **env,
        ),
    )  # fmt: skip


def _reporters(sink: OtlpSink) -> dict[str, list[tuple[dict[str, Any], bytes]]]:
    """Resources (attributes, encoded) of the wrapper's GPU series, of the trainer's training
    series and of its spans."""
    found: dict[str, list[tuple[dict[str, Any], bytes]]] = {"gpu": [], "training": [], "spans": []}
    for _peer, req in sink.metric_requests:
        for rm in req.resource_metrics:
            names = {m.name for sm in rm.scope_metrics for m in sm.metrics}
            entry = (attrs(rm.resource.attributes), rm.resource.SerializeToString())
            if "hw.gpu.memory.usage" in names:
                found["gpu"].append(entry)
            if {"training.phase", "training.step"} & names:
                found["training"].append(entry)
    for _peer, req in sink.trace_requests:
        for rs in req.resource_spans:
            found["spans"].append((attrs(rs.resource.attributes), rs.resource.SerializeToString()))
    assert all(found.values()), {k: len(v) for k, v in found.items()}
    return found


def _routing_keys() -> list[str]:
    exporters = yaml.safe_load(GATEWAY.read_text())["exporters"]
    return exporters["load_balancing/otel-gpu"]["routing_attributes"]  # type: ignore[no-any-return]


def _one_job(found: dict[str, list[tuple[dict[str, Any], bytes]]]) -> str:
    """Every reporter names the same job (to the processor and to the gateway), each process
    with its own instance id unless the user gave one; the job's id."""
    everything = [entry for entries in found.values() for entry in entries]
    assert len({r[JOB] for r, _raw in everything}) == 1
    gpu, trainer = found["gpu"][0], found["training"][0]
    assert "process.pid" not in gpu[0] and isinstance(trainer[0]["process.pid"], int)
    jobs = {resource_info(raw).job for _r, raw in everything}
    assert len(jobs) == 1, jobs  # the phase applies to the wrapper's GPUs
    assert resource_info(gpu[1]).label != resource_info(trainer[1]).label  # two processes
    keys = _routing_keys()
    assert len({tuple(r.get(k) for k in keys) for r, _raw in everything}) == 1  # one replica
    return str(gpu[0][JOB])


@pytest.mark.process
def test_the_wrapper_and_the_instrumented_trainer_report_one_job(tmp_path: Path) -> None:
    worker_id = tmp_path / "worker-id"
    with OtlpSink() as sink:
        res = _run(sink, tmp_path, INSTRUMENT, sys.executable, "-c", TRAINER, str(worker_id))
        assert res.returncode == 0, res.stderr[-3000:]
        found = _reporters(sink)
    job_id = _one_job(found)
    assert uuid.UUID(job_id).version == 4
    assert res.stdout.splitlines()[0] == f"{JOB}={job_id}"  # handed to the job's environment
    # one instance per process: the wrapper's and the trainer's differ, neither is the job's
    gpu_id, trainer_id = found["gpu"][0][0][ID], found["training"][0][0][ID]
    assert len({gpu_id, trainer_id, job_id}) == 3 and uuid.UUID(trainer_id).version == 4
    assert found["spans"][0][0][ID] == trainer_id
    # the forked worker keeps the job and its parent's instance (the SDK alone: a new one)
    assert worker_id.read_text() == f"{job_id} {trainer_id}"
    assert found["gpu"][0][0]["service.name"] == found["spans"][0][0]["service.name"]

    # Another run is another job, even with a malformed OTEL_RESOURCE_ATTRIBUTES, kept as it was.
    with OtlpSink() as sink:
        show = "import os; print(os.environ['OTEL_RESOURCE_ATTRIBUTES'])"
        res = _run(sink, tmp_path, sys.executable, "-c", show,
                   OTEL_RESOURCE_ATTRIBUTES="team=ml,oops")  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        wrapper = [attrs(rm.resource.attributes) for _p, r in sink.metric_requests
                   for rm in r.resource_metrics]  # fmt: skip
    other_id = wrapper[0][JOB]
    assert other_id != job_id and uuid.UUID(other_id).version == 4
    assert res.stdout.strip() == f"team=ml,oops,{JOB}={other_id}"
    assert wrapper[0]["team"] == "ml"


@pytest.mark.process
@pytest.mark.parametrize("flag", [(), ("--service-name", "sft")])
def test_a_user_given_id_is_kept_by_the_wrapper_and_the_trainer(
    tmp_path: Path, flag: tuple[str, ...]
) -> None:
    given = "service.namespace=ml-team,service.instance.id=sft%2Frun-7"
    with OtlpSink() as sink:
        res = _run(sink, tmp_path, INSTRUMENT, sys.executable, "-c", TRAINER,
                   str(tmp_path / "worker-id"), options=flag,
                   OTEL_RESOURCE_ATTRIBUTES=given)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        found = _reporters(sink)
    assert _one_job(found) == "sft/run-7"  # a given instance id still names the job
    assert res.stdout.splitlines()[0] == f"{given},{JOB}=sft%2Frun-7"  # kept, the key added
    # the given instance id is inherited: the user's choice, kept
    assert {r[ID] for entries in found.values() for r, _ in entries} == {"sft/run-7"}
    assert {r["service.namespace"] for entries in found.values() for r, _ in entries} == {"ml-team"}
    if flag:  # --service-name names the trainer's service too
        assert {r["service.name"] for entries in found.values() for r, _ in entries} == {"sft"}


# An instrumented trainer without the wrapper starts a child (a launcher's rank, a helper).
PARENT = """
import os, subprocess, sys
from opentelemetry import trace
print(trace.get_tracer_provider().resource.attributes["otel_gpu.job.id"])
subprocess.run([sys.executable, "-c", "import os; print(os.environ['OTEL_RESOURCE_ATTRIBUTES'])"])
"""


@pytest.mark.process
def test_an_instrumented_process_hands_its_id_to_the_processes_it_starts(tmp_path: Path) -> None:
    with OtlpSink() as sink:
        res = subprocess.run(
            [INSTRUMENT, sys.executable, "-c", PARENT], capture_output=True, text=True,
            timeout=120, cwd=tmp_path,
            env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true",
                     OTEL_GPU_LOCK_DIR=str(tmp_path), OTEL_RESOURCE_ATTRIBUTES="team=ml",
                     PYTHONPATH=str(ROOT)),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    parent_id, child_env = res.stdout.splitlines()
    assert uuid.UUID(parent_id).version == 4
    assert child_env == f"team=ml,{JOB}={parent_id}"
