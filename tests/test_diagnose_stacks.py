"""Every rank's stack (issue 21 §2): py-spy, the channel's ``stacks`` op and the faulthandler
fallback on real processes; ByteRobust-style grouping on their results."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support.paths import ROOT

from otel_gpu.diagnose import stacks
from otel_gpu.diagnose.jobprocs import JobProcess, job_processes
from otel_gpu.diagnose.stacks import Frame, ProcessStacks, ThreadStack

TORCH = "/site-packages/torch/distributed/"


def _proc(pid, rank, *frames, worker=False):
    fr = tuple(Frame(f, file, line) for f, file, line in frames)
    return ProcessStacks(pid, rank, worker, "py-spy", (ThreadStack("MainThread", pid, True, fr),))


def _waiting(pid, rank):
    return _proc(
        pid,
        rank,
        ("all_reduce", "/venv/lib/python3.11" + TORCH + "distributed_c10d.py", 2950),
        ("wrapper", "/venv/lib/python3.11" + TORCH + "c10d_logger.py", 81),
        ("train_step", "/job/train.py", 120),
        ("main", "/job/train.py", 140),
    )


@pytest.mark.unit
def test_the_odd_rank_comes_first_named_by_function_and_line():
    odd = _proc(
        4242,
        1,
        ("sleep", "/usr/lib/python3.11/asyncio/tasks.py", 600),
        ("fetch_remote_shard", "/job/data.py", 88),
        ("main", "/job/train.py", 139),
    )
    groups = stacks.group([_waiting(4241, 0), odd, _waiting(4243, 2)])
    assert [g.line() for g in groups] == [
        "rank 1 (PID 4242) in sleep at data.py:88",
        "ranks 0, 2 in all_reduce at train.py:120",
    ]
    assert [g.odd for g in groups] == [True, False]
    assert stacks.summary(groups) == (
        "rank 1 (PID 4242) in sleep at data.py:88 · ranks 0, 2 in all_reduce at train.py:120"
    )


@pytest.mark.unit
def test_a_user_function_blocked_in_c_is_named_itself():
    # time.sleep is C: no library frame inside the user's own one.
    p = _proc(7, 1, ("fetch_remote_shard", "/job/data.py", 88), ("main", "/job/train.py", 9))
    assert stacks.locate(p.threads[0].frames) == ("fetch_remote_shard", "data.py:88")


@pytest.mark.unit
def test_the_agents_own_wrappers_are_not_where_the_job_is():
    # otel-gpu's collective timing wraps torch.distributed: its frames sit between torch and the
    # job, wherever the job's copy of the package lives, and are left out of place and grouping.
    timing = "/opt/job-venv/lib/python3.11/site-packages/otel_gpu/tracing/collective_timing.py"

    def timed(pid, rank, op, line):
        return _proc(
            pid,
            rank,
            ("wait", timing, 178),
            (op, "/venv/lib/python3.11" + TORCH + "distributed_c10d.py", 2950),
            (
                "collective",
                timing.replace("/opt/job-venv/lib/python3.11/site-packages", "/src"),
                150,
            ),
            ("train_step", "/job/train.py", line),
        )

    groups = stacks.group([timed(1, 0, "all_reduce", 120), timed(2, 1, "broadcast", 130),
                           timed(3, 2, "all_reduce", 120)])  # fmt: skip
    assert [g.line() for g in groups] == [
        "rank 1 (PID 2) in broadcast at train.py:130",
        "ranks 0, 2 in all_reduce at train.py:120",
    ]
    assert all(not f.filename.endswith("collective_timing.py") for g in groups for f in g.frames)
    # A user's own file that happens to sit under a folder of the same name is still the job's.
    assert not stacks.is_agent("/home/me/otel_gpu/train.py")
    assert stacks.is_agent("/src/otel_gpu/tracing/collective_timing.py")


@pytest.mark.unit
def test_ranks_are_written_as_ranges_and_failures_are_listed():
    procs = [_waiting(100 + r, r) for r in range(64) if r != 17]
    procs.append(ProcessStacks(117, 17, error="py-spy: Permission denied; channel: timed out"))
    groups = stacks.group(procs)
    assert [g.line() for g in groups] == ["ranks 0-16, 18-63 in all_reduce at train.py:120"]
    lines = stacks.describe(groups, procs)
    assert lines[1] == "rank 17 (PID 117): no stack (py-spy: Permission denied; channel: timed out)"


@pytest.mark.unit
def test_the_faulthandler_format_is_parsed_main_thread_last(tmp_path: Path):
    release = threading.Event()

    def helper_waits_here():
        release.wait(10)

    t = threading.Thread(target=helper_waits_here, name="helper")
    t.start()
    try:
        path = tmp_path / "dump.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
    finally:
        release.set()
        t.join()
    threads = stacks.parse_faulthandler(path.read_text())
    assert len(threads) >= 2
    main = [t for t in threads if t.main]
    assert len(main) == 1 and main[0].ident == threading.main_thread().ident
    assert any(f.function == "test_the_faulthandler_format_is_parsed_main_thread_last"
               for f in main[0].frames)  # fmt: skip
    helper = [t for t in threads if any(f.function == "helper_waits_here" for f in t.frames)]
    assert len(helper) == 1 and not helper[0].main


@pytest.mark.unit
def test_the_stacks_op_answers_every_thread_but_the_asking_one():
    release = threading.Event()

    def blocked_in_named_function():
        release.wait(10)

    t = threading.Thread(target=blocked_in_named_function, name="worker-7")
    t.start()
    try:
        reply = {}
        asker = threading.Thread(target=lambda: reply.update(stacks.handle_stacks({})))
        asker.start()
        asker.join()
    finally:
        release.set()
        t.join()
    threads = stacks.parse_channel(reply)
    by_name = {t.name: t for t in threads}
    assert "worker-7" in by_name and by_name["worker-7"].frames[1].function == "wait"
    assert by_name["worker-7"].frames[2].function == "blocked_in_named_function"
    assert by_name["MainThread"].main
    assert len([t for t in threads if t.main]) == 1
    assert reply["pid"] == os.getpid()


# --- real processes -------------------------------------------------------------------------

JOB = textwrap.dedent(
    """
    import sys, threading, time
    import otel_gpu  # noqa: F401  (the in-process part, under opentelemetry-instrument)

    def fetch_remote_shard():
        sys.stdin.readline()

    def announce():
        # "ready" only once the main thread sits in fetch_remote_shard's read, so that no
        # way can catch it a line early, between printing and reading
        main = threading.main_thread().ident
        while sys._current_frames()[main].f_code.co_name != "fetch_remote_shard":
            time.sleep(0.005)
        print("ready", flush=True)

    threading.Thread(target=announce).start()
    fetch_remote_shard()
    """
)
BLOCKED_AT = f"<string>:{JOB.splitlines().index('    sys.stdin.readline()') + 1}"


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def _start(private_dir: Path, instrumented: bool = True) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OTEL_GPU_RUNTIME_DIR": str(private_dir),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_GPU_DETECT": "false",
        "OTEL_GPU_ROLE": "trainer",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
    }
    argv = [sys.executable, "-c", JOB]
    if instrumented:
        argv = [os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument"), *argv]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
    return proc


def _finish(proc: subprocess.Popen[str]) -> None:
    proc.communicate("\n", timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.process
@pytest.mark.parametrize("way", [stacks.PYSPY, stacks.CHANNEL, stacks.FAULTHANDLER])
def test_each_way_finds_the_function_a_process_is_blocked_in(private_dir: Path, way: str):
    proc = _start(private_dir)
    try:
        [jp] = job_processes(proc.pid)
        assert (jp.pid, jp.rank, jp.worker) == (proc.pid, 1, False)
        pyspy = stacks.find_pyspy(os.path.dirname(sys.executable)) if way == stacks.PYSPY else None
        got = stacks.collect_one(jp, pyspy=pyspy, only=(way,))
        assert got.method == way, got.error
        [g] = stacks.group([got])
        assert (g.function, g.where) == ("fetch_remote_shard", BLOCKED_AT)
        assert got.took_s < 5
    finally:
        _finish(proc)  # the process was never harmed: it finishes with its own code
    assert not os.path.exists(stacks.dump_path(str(private_dir), proc.pid))  # removed at exit


@pytest.mark.process
def test_without_py_spy_the_channel_answers_and_py_spy_is_named_missing(private_dir: Path):
    proc = _start(private_dir)
    try:
        [got] = stacks.collect(
            job_processes(proc.pid), pyspy=stacks.find_pyspy(path="/nonexistent")
        )
        assert got.method == stacks.CHANNEL
    finally:
        _finish(proc)


@pytest.mark.process
def test_a_process_without_the_in_process_part_is_never_signalled(private_dir: Path):
    # No handler for the stack signal: sending it would kill the process. Reported, not sent.
    proc = _start(private_dir, instrumented=False)
    try:
        got = stacks.collect_one(
            JobProcess(proc.pid, 1, False, {"OTEL_GPU_RUNTIME_DIR": str(private_dir)}),
            pyspy=None,
        )
        assert got.method is None
        assert got.error is not None and "faulthandler: no in-process faulthandler" in got.error
        assert "py-spy: not on PATH" in got.error
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        _finish(proc)
