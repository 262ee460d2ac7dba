"""``otel-gpu diagnose stall`` on real torchrun jobs (gloo, CPU) hung in known ways (issue 21
§4, §2, §3): the odd rank named by function and line, the others' collective, the flight
recorder's missing rank or mismatch; py-spy where it may attach, else the in-process part."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import clean_env, otel_gpu
from support.paths import ROOT
from support.ports import free_port

HANG_JOB = ROOT / "tests" / "support" / "hang_job.py"
BIN = os.path.dirname(sys.executable)  # the venv's: opentelemetry-instrument, py-spy
NO_PYSPY_PATH = "/usr/local/bin:/usr/bin:/bin"


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    values = {
        "PYTHONPATH": str(ROOT),
        "OTEL_GPU_RUNTIME_DIR": str(run_dir),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_GPU_DETECT": "false",
        "HANG_JOB_MAX_S": "90",
    }
    return clean_env(**{**values, **extra})


class HungJob:
    """``opentelemetry-instrument torchrun --nproc-per-node N hang_job.py MODE``, waited for
    until every rank has trained its steps (then it hangs); terminated at the end."""

    def __init__(self, tmp_path: Path, mode: str, ranks: int = 3) -> None:
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir(mode=0o700)
        self.log = tmp_path / "job.log"
        self.ranks = ranks
        port = str(free_port())
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [os.path.join(BIN, "opentelemetry-instrument"), sys.executable, "-m",
                 "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", port,
                 str(HANG_JOB), mode],
                stdout=log, stderr=subprocess.STDOUT, env=_env(self.run_dir),
                start_new_session=True,
            )  # fmt: skip

    def wait_hung(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()
            if text.count(" at step 3") >= self.ranks:
                time.sleep(0.5)  # the last rank enters its hang
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"the job did not reach its hang:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # this test's own job
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture
def blocked(tmp_path: Path):
    job = HungJob(tmp_path, "blocked")
    try:
        job.wait_hung()
        yield job
    finally:
        job.stop()


def _diagnose(job: HungJob, *args: str, path: str | None = None) -> dict:
    env = _env(job.run_dir, PATH=path or f"{BIN}:{NO_PYSPY_PATH}")
    started = time.monotonic()
    res = otel_gpu("diagnose", "stall", "--pid", str(job.proc.pid), "--json", *args, env=env)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    out["cli_s"] = took
    return out


def _groups(out: dict) -> list[tuple[list[int], str, str]]:
    return [(g["ranks"], g["function"], g["where"]) for g in out["groups"]]


@pytest.mark.peers
def test_a_rank_blocked_in_a_function_while_the_others_wait_in_all_reduce(blocked: HungJob):
    expected = [
        ([1], "fetch_remote_shard", "hang_job.py:36"),
        ([0, 2], "all_reduce", "hang_job.py:50"),
    ]
    for path, methods in ((None, {"py-spy"}), (NO_PYSPY_PATH, {"channel"})):
        out = _diagnose(blocked, path=path)
        assert _groups(out) == expected, out["summary"]
        assert {p["method"] for p in out["processes"]} == methods
        missing = [c for c in out["collectives"] if c["kind"] == "missing"]
        assert [(c["seq"], c["op"], c["ranks"]) for c in missing] == [(4, "all_reduce", [1])]
        assert out["took_s"] < 10
    # ptrace denied or py-spy absent, and the interpreter unable to answer: the faulthandler.
    out = _diagnose(blocked, "--via", "faulthandler", path=NO_PYSPY_PATH)
    assert _groups(out) == expected
    assert {p["method"] for p in out["processes"]} == {"faulthandler"}
    # The human form: one line, the odd one out first, then the collective.
    res = otel_gpu("diagnose", "stall", "--pid", str(blocked.proc.pid),
                   env=_env(blocked.run_dir, PATH=NO_PYSPY_PATH))  # fmt: skip
    pids = {p["rank"]: p["pid"] for p in out["processes"]}
    assert res.stdout.splitlines()[:2] == [
        f"rank 1 (PID {pids[1]}) in fetch_remote_shard at hang_job.py:36"
        " · ranks 0, 2 in all_reduce at hang_job.py:50",
        "collective 4 all_reduce (default_pg): rank 1 missing (ranks 0, 2 waiting)",
    ]
    # Any rank's PID finds the whole job.
    res = otel_gpu("diagnose", "stall", "--pid", str(pids[2]), "--json",
                   env=_env(blocked.run_dir, PATH=NO_PYSPY_PATH))  # fmt: skip
    assert _groups(json.loads(res.stdout)) == expected
    assert blocked.proc.poll() is None  # looking harmed no rank
    # The launcher under opentelemetry-instrument gave its ranks the flight recorder's variables.
    environ = Path(f"/proc/{pids[1]}/environ").read_bytes().split(b"\0")
    assert b"TORCH_NCCL_DEBUG_INFO_PIPE_FILE=" + bytes(blocked.run_dir) + b"/fr-pipe-" in environ


@pytest.mark.peers
def test_two_ranks_calling_different_collectives_is_a_mismatch(tmp_path: Path):
    job = HungJob(tmp_path, "mismatch")
    try:
        job.wait_hung()
        out = _diagnose(job, path=NO_PYSPY_PATH)
    finally:
        job.stop()
    assert _groups(out) == [
        ([1], "broadcast", "hang_job.py:73"),
        ([0, 2], "all_reduce", "hang_job.py:50"),
    ]
    [c] = out["collectives"]
    assert (c["kind"], c["seq"], c["ranks"]) == ("mismatch", 4, [1])
    assert (
        c["line"] == "collective 4 mismatch (default_pg): rank 1 broadcast, ranks 0, 2 all_reduce"
    )


@pytest.mark.peers
def test_a_rank_stuck_in_its_dataloader_worker(tmp_path: Path):
    # py-spy sees the worker (a forked child serves no channel): rank 1 waits in the loader's
    # __next__, its worker is stuck in the dataset, the others wait in all_reduce.
    job = HungJob(tmp_path, "loader")
    try:
        job.wait_hung()
        out = _diagnose(job)
    finally:
        job.stop()
    groups = [(g["ranks"], g["workers"], g["function"], g["where"]) for g in out["groups"]]
    assert groups == [
        ([1], [False], "__next__", "hang_job.py:78"),
        ([1], [True], "fetch_remote_shard", "hang_job.py:36"),
        ([0, 2], [False, False], "all_reduce", "hang_job.py:50"),
    ]
    assert out["summary"].startswith("rank 1 (PID ")
    assert " · rank 1 worker (PID " in out["summary"]


@pytest.mark.process
def test_cannot_look_is_one_line_and_exit_2(tmp_path: Path):
    res = otel_gpu("diagnose", "stall", "--pid", "999999999")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "no process 999999999" in res.stderr and "Traceback" not in res.stderr
    # A process of ours without the in-process part, and py-spy absent: nothing to see.
    plain = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"],
                             stdin=subprocess.PIPE, text=True)  # fmt: skip
    try:
        time.sleep(0.3)
        res = otel_gpu("diagnose", "stall", "--pid", str(plain.pid),
                       env=clean_env(PATH=NO_PYSPY_PATH, OTEL_GPU_RUNTIME_DIR=str(tmp_path)))  # fmt: skip
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "cannot look into the job of --pid" in res.stderr
        assert "py-spy: not on PATH" in res.stderr and "opentelemetry-instrument" in res.stderr
        assert plain.poll() is None  # not signalled: it has no handler for the stack signal
    finally:
        plain.communicate("\n", timeout=10)
    res = otel_gpu("diagnose", "stall", "--pid", "1", "--via", "gdb")
    assert res.returncode == 2 and "--via 'gdb'" in res.stderr


FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
           "TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # fmt: skip


@pytest.mark.process
def test_otel_gpu_run_gives_the_job_the_flight_recorder_unless_set_or_switched_off(tmp_path):
    show = f"import os; print([os.environ.get(v) for v in {FR_VARS!r}])"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    base = {"OTEL_GPU_RUNTIME_DIR": str(run_dir)}
    cases = [
        (base, ["2000", None, f"{run_dir}/fr-pipe-", f"{run_dir}/fr-dump-"]),
        ({**base, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/"},
         [None, "0", f"{run_dir}/fr-pipe-", "/x/"]),
        ({**base, "OTEL_GPU_FLIGHT_RECORDER": "false"}, [None, None, None, None]),
    ]  # fmt: skip
    for extra, expected in cases:
        res = otel_gpu("run", "--exporter", "none", "--no-detect", "--", sys.executable, "-c",
                       show, env=clean_env(**extra))  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().splitlines()[-1] == repr(expected)


@pytest.mark.peers
def test_the_stall_alert_of_otel_gpu_run_says_where_the_job_is_stuck(tmp_path: Path):
    # otel-gpu run -- torchrun (ranks instrumented by the wrapper): the trainers' steps reach
    # the engine over the channel; the steps stop; the stall alert carries the diagnosis.
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    summary = tmp_path / "summary.json"
    env = _env(run_dir, HANG_JOB_MAX_S="25", HANG_JOB_STEP_S="0.4",
               OTEL_GPU_DETECT_STALL_STEP_FLOOR_S="3", OTEL_GPU_DETECT="true",
               PATH=NO_PYSPY_PATH)  # fmt: skip
    port = str(free_port())
    res = otel_gpu(
        "run", "--simulate", "steady", "--interval", "0.5", "--exporter", "none",
        "--summary-json", str(summary), "--", sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", "3", "--master-port", port, str(HANG_JOB), "blocked", "8",
        env=env, timeout=240,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]  # torchrun's own code: rank 1 gave up (7)
    [alert] = [a for a in json.loads(summary.read_text())["alerts"] if a["kind"] == "stall"]
    assert "training step stuck at 8" in alert["message"]
    stuck_s = int(re.search(r"for (\d+) s", alert["message"]).group(1))
    assert stuck_s <= 20  # 20 typical steps (~0.5 s each), not the 15-minute window
    found = alert["diagnosis"]
    pid1 = found["data"]["groups"][0]["pids"][0]
    assert found["lines"] == [
        f"rank 1 (PID {pid1}) in fetch_remote_shard at hang_job.py:36",
        "ranks 0, 2 in all_reduce at hang_job.py:50",
        "collective 9 all_reduce (default_pg): rank 1 missing (ranks 0, 2 waiting)",
    ]
    assert {p["method"] for p in found["data"]["processes"]} == {"channel"}
    assert found["took_s"] < 10
    assert f"rank 1 (PID {pid1}) in fetch_remote_shard at hang_job.py:36" in res.stdout + res.stderr


@pytest.mark.peers
def test_the_in_process_node_agents_stall_alert_says_where(tmp_path: Path):
    # opentelemetry-instrument torchrun: local rank 0's node agent watches torchrun's tree,
    # learns the steps in process, and its stall alert (the breaker's log line) says where.
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = _env(run_dir, OTEL_GPU_DETECT="true", OTEL_GPU_SIMULATE="steady",
               OTEL_GPU_INTERVAL="0.5", OTEL_GPU_DETECT_STALL_STEP_FLOOR_S="3",
               HANG_JOB_MAX_S="25", HANG_JOB_STEP_S="0.4", PATH=NO_PYSPY_PATH)  # fmt: skip
    port = str(free_port())
    res = subprocess.run(
        [os.path.join(BIN, "opentelemetry-instrument"), sys.executable, "-m",
         "torch.distributed.run", "--nproc-per-node", "3", "--master-port", port,
         str(HANG_JOB), "blocked", "8"],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]  # torchrun's own code for a failed rank
    opened = [ln for ln in res.stderr.splitlines() if "opened on 1 stall alert" in ln]
    assert len(opened) == 1, res.stderr[-3000:]
    assert "training step stuck at 8 for" in opened[0]
    assert re.search(
        r"where: rank 1 \(PID \d+\) in fetch_remote_shard at hang_job.py:36", opened[0]
    )
