"""Resource detectors against real git repositories, real environments and the real SDK."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml
from opentelemetry.sdk.resources import get_aggregated_resources

from otel_gpu.core.job_identity import instance_id
from otel_gpu.resource import (
    GitResourceDetector,
    GpuHostResourceDetector,
    JobResourceDetector,
    canonical_repo_url,
    host_attributes,
    job_attributes,
)
from otel_gpu.sampling.sim import SimulatedSource
from otel_gpu.sampling.source import HostInfo

TOKEN = "ghp_s3cretT0ken"


@pytest.fixture(autouse=True)
def _git_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Keep the user's git config and any enclosing repository out of these tests.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_DIR", "GIT_WORK_TREE", "OTEL_GPU_GIT_DIR"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "gitconfig").write_text(
        "[user]\n\tname = t\n\temail = t@example.com\n[init]\n\tdefaultBranch = main\n"
        '[protocol "file"]\n\tallow = always\n'
    )


def git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def make_repo(path: Path, origin: str | None = None) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    (path / "train.py").write_text("print('hi')\n")
    git(path, "add", "train.py")
    git(path, "commit", "-q", "-m", "first")
    if origin:
        git(path, "remote", "add", "origin", origin)
    return path


def detect(cwd: Path, **kw: float) -> dict:
    return dict(GitResourceDetector(cwd=str(cwd), **kw).detect().attributes)


# -- git ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_branch_url_without_credentials_revision_and_clean(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", f"https://alice:{TOKEN}@github.com/org/repo.git")
    (tmp_path / "repo" / "sub").mkdir()
    attrs = detect(repo / "sub")  # found from a subdirectory too
    assert attrs == {
        "vcs.repository.url.full": "https://github.com/org/repo",
        "vcs.repository.name": "repo",
        "vcs.ref.head.revision": git(repo, "rev-parse", "HEAD"),
        "vcs.ref.head.name": "main",
        "vcs.ref.head.type": "branch",
        "otel_gpu.vcs.dirty": False,
    }
    assert TOKEN not in repr(attrs) and "alice" not in repr(attrs)


@pytest.mark.process
def test_dirty_only_for_tracked_changes(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "output.log").write_text("untracked\n")
    assert detect(repo)["otel_gpu.vcs.dirty"] is False
    (repo / "train.py").write_text("print('changed')\n")
    assert detect(repo)["otel_gpu.vcs.dirty"] is True


@pytest.mark.process
def test_detached_head_on_tag_and_off_tag(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", "git@gitlab.example.com:group/sub/repo.git")
    git(repo, "tag", "v1.0")
    first = git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("print(2)\n")
    git(repo, "commit", "-q", "-am", "second")
    git(repo, "checkout", "-q", "--detach", "v1.0")
    attrs = detect(repo)
    assert attrs["vcs.ref.head.revision"] == first
    assert (attrs["vcs.ref.head.name"], attrs["vcs.ref.head.type"]) == ("v1.0", "tag")
    assert attrs["vcs.repository.url.full"] == "https://gitlab.example.com/group/sub/repo"

    git(repo, "checkout", "-q", "--detach", "main")
    attrs = detect(repo)
    assert attrs["vcs.ref.head.revision"] == git(repo, "rev-parse", "HEAD") != first
    assert "vcs.ref.head.name" not in attrs and "vcs.ref.head.type" not in attrs


@pytest.mark.process
def test_submodule_revisions(tmp_path: Path) -> None:
    lib = make_repo(tmp_path / "lib")
    repo = make_repo(tmp_path / "repo")
    git(repo, "submodule", "add", "-q", str(lib), "third_party/lib")
    git(repo, "commit", "-q", "-m", "add submodule")
    attrs = detect(repo)
    assert attrs["otel_gpu.vcs.submodules"] == (f"third_party/lib@{git(lib, 'rev-parse', 'HEAD')}",)
    assert attrs["otel_gpu.vcs.dirty"] is False
    assert "vcs.repository.url.full" not in attrs  # no remote: no URL, never a made-up one


@pytest.mark.process
def test_git_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo", "ssh://git@example.com:2222/org/proj.git")
    monkeypatch.setenv("OTEL_GPU_GIT_DIR", str(repo))
    monkeypatch.chdir(tmp_path)  # not a repository
    attrs = dict(GitResourceDetector().detect().attributes)
    assert attrs["vcs.repository.url.full"] == "https://example.com/org/proj"


@pytest.mark.process
def test_outside_repository_is_empty_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "otel_gpu.resource")
    assert detect(tmp_path) == {}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not inside a git repository" in warnings[0].getMessage()


@pytest.mark.process
def test_a_trainer_under_otel_gpu_run_leaves_the_warning_to_its_wrapper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_GPU_WATCHED_BY", "4242")  # as otel-gpu run sets it in its job
    caplog.set_level(logging.DEBUG, "otel_gpu.resource")
    assert detect(tmp_path) == {}
    said = [r for r in caplog.records if "not inside a git repository" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.DEBUG]  # said, once, but not into the job's output


@pytest.mark.process
def test_slow_git_is_cut_off_and_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    repo = make_repo(tmp_path / "repo")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    pidfile = tmp_path / "sleeper.pid"
    # The hung part is a grandchild holding the output pipe: killing only `git` would not do.
    (bindir / "git").write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {pidfile}\nwait\n")
    (bindir / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    caplog.set_level(logging.WARNING, "otel_gpu.resource")
    started = time.monotonic()
    assert detect(repo, timeout_s=0.5) == {}
    assert time.monotonic() - started < 3.0
    assert "did not answer within 0.5 s" in caplog.text
    sleeper = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and _alive(sleeper):
        time.sleep(0.05)
    assert not _alive(sleeper), "the slow git's child outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.process
def test_no_git_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert detect(repo) == {}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (f"https://user:{TOKEN}@github.com/org/repo.git", "https://github.com/org/repo"),
        (f"https://{TOKEN}@github.com/org/repo", "https://github.com/org/repo"),
        ("http://tok@git.internal:8080/a/b.git/?private_token=x#f", "http://git.internal:8080/a/b"),
        ("git@github.com:org/repo.git", "https://github.com/org/repo"),
        ("gitlab.com:group/sub/repo.git", "https://gitlab.com/group/sub/repo"),
        ("ssh://git@example.com:2222/org/repo.git", "https://example.com/org/repo"),
        ("git://example.com/org/repo.git", "https://example.com/org/repo"),
        ("https://[::1]:8443/org/repo.git", "https://[::1]:8443/org/repo"),
        ("/srv/git/repo.git", "file:///srv/git/repo"),
        ("../repo.git", "file:///base/repo"),
        ("file:///srv/git/repo.git", "file:///srv/git/repo"),
        ("", None),
    ],
)
def test_canonical_repo_url(raw: str, expected: str | None) -> None:
    assert canonical_repo_url(raw, base_dir="/base/here") == expected


# -- GPU host ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_host_attributes_from_host_info() -> None:
    info = HostInfo("550.54.15", "12.4", 2, ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"))
    assert host_attributes(info) == {
        "otel_gpu.gpu.driver.version": "550.54.15",
        "otel_gpu.gpu.cuda_driver.version": "12.4",
        "otel_gpu.gpu.count": 2,
        "otel_gpu.gpu.models": ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"],
    }
    assert host_attributes(HostInfo()) == {}  # unknown stays out, never 0 or ""


@pytest.mark.unit
def test_host_detector_with_simulated_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_GPU_SIMULATE", "steady")
    attrs = dict(GpuHostResourceDetector().detect().attributes)
    assert attrs["otel_gpu.gpu.count"] == 1
    assert attrs["otel_gpu.gpu.models"] == ("Simulated H100 80GB",)
    two = GpuHostResourceDetector(source_factory=lambda: SimulatedSource(gpus=2)).detect()
    assert two.attributes["otel_gpu.gpu.count"] == 2


@pytest.mark.process
def test_host_detector_reads_nvml(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml.write(
        """
        devices = 2
        driver_version = 560.35.03
        cuda_driver_version = 12060
        gpu.0.name = NVIDIA A100-SXM4-80GB
        gpu.1.name = NVIDIA H100 80GB HBM3
        """
    )
    monkeypatch.setenv("OTEL_GPU_NVML_LIBRARY", str(fake_nvml.library))
    monkeypatch.setenv("FAKE_NVML_STATS", str(fake_nvml.stats_path))
    monkeypatch.delenv("OTEL_GPU_SIMULATE", raising=False)
    assert dict(GpuHostResourceDetector().detect().attributes) == {
        "otel_gpu.gpu.driver.version": "560.35.03",
        "otel_gpu.gpu.cuda_driver.version": "12.6",
        "otel_gpu.gpu.count": 2,
        "otel_gpu.gpu.models": ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"),
    }
    # NVML was asked by a child process (a driver fault there cannot end this one), which
    # shut it down again.
    assert fake_nvml.call_count("nvmlInitWithFlags") == 0
    assert fake_nvml.child_stats()[("nvmlShutdown", -1)] == 1


@pytest.mark.process
def test_host_detector_bounded_when_nvml_hangs(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_nvml.append("delay.nvmlInitWithFlags = 1200")
    monkeypatch.setenv("OTEL_GPU_NVML_LIBRARY", str(fake_nvml.library))
    monkeypatch.delenv("OTEL_GPU_SIMULATE", raising=False)
    caplog.set_level(logging.WARNING, "otel_gpu.resource")
    started = time.monotonic()
    res = GpuHostResourceDetector(timeout_s=0.3).detect()
    assert res.attributes == {}
    assert time.monotonic() - started < 1.0
    assert "NVML did not answer in 0.3s" in caplog.text


@pytest.mark.unit
def test_host_detector_failure_is_empty_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "otel_gpu.resource")
    res = GpuHostResourceDetector(source_factory=lambda: SimulatedSource("bogus")).detect()
    assert res.attributes == {}
    assert "unknown scenario" in caplog.text


# -- job ---------------------------------------------------------------------------------------


@pytest.mark.unit
def test_torchrun_and_slurm_environment() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "run-42",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "sft",
        "SLURM_ARRAY_JOB_ID": "123400",
        "SLURM_ARRAY_TASK_ID": "7",
        "SLURM_PROCID": "5",
        "SLURM_NODEID": "1",
    }
    assert dict(JobResourceDetector(env=env).detect().attributes) == {
        "service.instance.id": instance_id(env),  # none given: this process's
        "otel_gpu.job.id": instance_id(env),  # no job named: a job of one process
        "otel_gpu.job.rank": 5,
        "otel_gpu.job.local_rank": 1,
        "otel_gpu.job.world_size": 8,
        "otel_gpu.job.local_world_size": 4,
        "otel_gpu.job.node_rank": 1,
        "otel_gpu.job.run_id": "run-42",
        "otel_gpu.slurm.job.id": "123456",
        "otel_gpu.slurm.job.name": "sft",
        "otel_gpu.slurm.array_job.id": "123400",
        "otel_gpu.slurm.array_task.id": "7",
        "otel_gpu.slurm.proc.id": 5,
        "otel_gpu.slurm.node.id": 1,
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    ("resource_attributes", "expected"),
    [
        ("service.instance.id=run-7", "run-7"),
        ("team=ml,service.instance.id=sft%2F7", "sft/7"),
        ("team=ml", None),  # none given: one id for this process, whatever asks
        ("service.instance.id=", None),
    ],
)
def test_the_job_is_named_by_the_given_id_else_by_this_processs(
    resource_attributes: str, expected: str | None
) -> None:
    env = {"OTEL_RESOURCE_ATTRIBUTES": resource_attributes}
    found = [JobResourceDetector(env=env).detect().attributes["service.instance.id"] for _ in "ab"]
    assert found[0] == found[1] == (expected or instance_id({}))
    if expected is None:
        assert uuid.UUID(str(found[0])).version == 4
    # Re-run after a fork, after the SDK's own detector that would give a worker a new id.
    assert JobResourceDetector(env=env).is_process_dependent()


@pytest.mark.unit
def test_kubernetes_from_downward_api_and_service_account(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": "sft-0", "NODE_NAME": "gpu-7"}
    ns_file = tmp_path / "namespace"
    ns_file.write_text("ml-team\n")
    assert job_attributes(env, str(ns_file)) == {
        "k8s.pod.name": "sft-0",
        "k8s.namespace.name": "ml-team",
        "k8s.node.name": "gpu-7",
    }
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "sft-1", "POD_NAMESPACE": "a"}
    assert job_attributes(env, str(tmp_path / "missing")) == {
        "k8s.pod.name": "sft-1",
        "k8s.namespace.name": "a",
    }
    # Outside Kubernetes a HOSTNAME is just a host name.
    assert job_attributes({"HOSTNAME": "box"}, str(ns_file)) == {}


@pytest.mark.unit
def test_bad_rank_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "otel_gpu.resource")
    assert job_attributes({"RANK": "zero", "WORLD_SIZE": "2"}) == {"otel_gpu.job.world_size": 2}
    assert "RANK='zero' is not an integer" in caplog.text


# -- through the SDK ---------------------------------------------------------------------------


@pytest.mark.process
def test_detectors_through_sdk_aggregation(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", "git@github.com:org/repo.git")
    res = get_aggregated_resources(
        [GitResourceDetector(cwd=str(repo)), JobResourceDetector(env={"RANK": "0"})]
    )
    assert res.attributes["vcs.repository.url.full"] == "https://github.com/org/repo"
    assert res.attributes["otel_gpu.job.rank"] == 0


@pytest.mark.process
def test_entry_points_selected_by_environment_variable(tmp_path: Path) -> None:
    """What ``opentelemetry-instrument`` does: Resource.create() honouring the env variable."""
    repo = make_repo(tmp_path / "repo", f"https://u:{TOKEN}@example.com/org/repo.git")
    code = (
        "import json; from opentelemetry.sdk.resources import Resource; "
        "print(json.dumps(dict(Resource.create().attributes)))"
    )
    env = dict(
        os.environ,
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel_gpu_git,otel_gpu_job,otel_gpu_host",
        OTEL_GPU_SIMULATE="steady",
        RANK="3",
        WORLD_SIZE="4",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    attrs = json.loads(out.stdout)
    assert attrs["vcs.repository.url.full"] == "https://example.com/org/repo"
    assert attrs["vcs.ref.head.revision"] == git(repo, "rev-parse", "HEAD")
    assert attrs["vcs.ref.head.name"] == "main"
    assert attrs["otel_gpu.job.rank"] == 3 and attrs["otel_gpu.job.world_size"] == 4
    assert attrs["otel_gpu.gpu.count"] == 1
    assert TOKEN not in out.stdout + out.stderr
