"""ProcessTree against a written /proc folder (namespaces, reuse, caps) and real processes."""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procfs import BTIME, FakeProc

from otel_gpu.core.redact import redact_command
from otel_gpu.sampling.procs import ProcessTree

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def by_pid(reading) -> dict:  # type: ignore[no-untyped-def]
    return {p.pid: p for p in reading.processes}


# -- written /proc -----------------------------------------------------------------------------


@pytest.mark.unit
def test_tree_fields_and_units(proc: FakeProc) -> None:
    root_user = pwd.getpwuid(0).pw_name
    proc.add(100, comm="torchrun", cmdline=("torchrun", "--nproc_per_node", "2", "train.py"))
    proc.add(101, ppid=100, threads=12, rss_pages=1000, vsize=5 << 30, nspid=(101, 7))
    proc.add(102, ppid=101, comm="pt_data_worker", exe=None, cmdline=())
    proc.add(200, ppid=1, comm="unrelated")
    tree = ProcessTree([100], proc_root=str(proc.root), cpu_count=2)
    reading = tree.sample()
    procs = by_pid(reading)
    assert list(procs) == [100, 101, 102]  # root first, then descendants; 200 is not in the tree
    assert tree.job_pids() == [100, 101, 102]
    worker = procs[101]
    assert (worker.parent_pid, worker.vpid, worker.thread_count) == (100, 7, 12)
    assert worker.memory_rss == 1000 * PAGE and worker.memory_virtual == 5 << 30
    assert worker.executable_name == "python3.11"  # from the exe link, not the 15-char comm
    assert worker.command == "python3 train.py" and worker.owner == root_user
    assert worker.fd_count == 2 and worker.in_tree
    assert worker.create_time == pytest.approx(BTIME + 1000 / CLK_TCK)
    assert worker.cpu_utilization is None  # first sight: no interval yet
    assert procs[100].vpid is None  # same PID in every namespace it belongs to
    assert procs[102].executable_name == "pt_data_worker" and procs[102].command is None
    assert reading.dropped == 0 and reading.unmapped_gpu_pids == ()


@pytest.mark.unit
def test_cpu_utilization_is_fraction_of_available_cpus(proc: FakeProc) -> None:
    clock = Clock()
    proc.add(100, utime=100, stime=50)
    tree = ProcessTree([100], proc_root=str(proc.root), cpu_count=2, clock=clock)
    tree.sample()
    clock.t += 2.0
    proc.add(100, utime=100 + CLK_TCK, stime=50 + CLK_TCK // 2)  # 1.5 CPU-seconds in 2 s
    assert by_pid(tree.sample())[100].cpu_utilization == pytest.approx(1.5 / 2.0 / 2)


@pytest.mark.unit
def test_comm_with_spaces_and_parentheses(proc: FakeProc) -> None:
    proc.add(100, comm="my (weird) name", exe=None, threads=3)
    sample = by_pid(ProcessTree([100], proc_root=str(proc.root)).sample())[100]
    assert sample.executable_name == "my (weird) name" and sample.thread_count == 3


@pytest.mark.unit
def test_zombie_reported_without_memory(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, ppid=100, state="Z", comm="sleep", exe=None, cmdline=(), fds=())
    tree = ProcessTree([100], proc_root=str(proc.root))
    z = by_pid(tree.sample())[101]
    assert z.executable_name == "sleep" and z.parent_pid == 100
    assert (z.memory_rss, z.memory_virtual, z.fd_count, z.thread_count) == (None,) * 4
    assert z.cpu_utilization is None


@pytest.mark.unit
def test_pid_reuse_is_a_new_process(proc: FakeProc) -> None:
    clock = Clock()
    proc.add(100)
    proc.add(101, ppid=100, starttime=1000, cmdline=("python3", "old.py"), utime=10)
    tree = ProcessTree([100], proc_root=str(proc.root), clock=clock)
    tree.sample()
    clock.t += 1
    tree.sample()
    # 101 exits; an unrelated process gets the same PID (new start time, parent 1).
    proc.add(101, ppid=1, starttime=5000, cmdline=("nginx",), utime=5000)
    clock.t += 1
    assert 101 not in by_pid(tree.sample())
    # ... and when the new holder is a child of the tree, nothing of the old one leaks over.
    proc.add(101, ppid=100, starttime=5000, cmdline=("python3", "new.py"), utime=5000)
    clock.t += 1
    new = by_pid(tree.sample())[101]
    assert new.command == "python3 new.py" and new.cpu_utilization is None


@pytest.mark.unit
def test_exec_replaces_the_cached_command(proc: FakeProc) -> None:
    proc.add(100, comm="sh", cmdline=("sh", "-c", "exec sleep 5"), exe="/bin/dash")
    tree = ProcessTree([100], proc_root=str(proc.root))
    assert by_pid(tree.sample())[100].executable_name == "dash"
    # exec() keeps the PID and start time; the program changes.
    proc.add(100, comm="sleep", cmdline=("sleep", "5"), exe="/usr/bin/sleep")
    s = by_pid(tree.sample())[100]
    assert (s.executable_name, s.command) == ("sleep", "sleep 5")


@pytest.mark.unit
def test_root_replaced_by_another_process_leaves_the_job(proc: FakeProc) -> None:
    proc.add(100, starttime=1000)
    proc.add(101, ppid=100)
    tree = ProcessTree([100], proc_root=str(proc.root))
    assert [p.pid for p in tree.sample().processes] == [100, 101]
    proc.add(100, starttime=9999, cmdline=("other",))  # the PID now names another process
    assert [p.pid for p in tree.sample().processes] == [101]  # the orphan stays in the job
    assert tree.job_pids() == [101]


@pytest.mark.unit
def test_reparented_descendant_stays_and_set_roots_starts_over(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, ppid=100)
    proc.add(102, ppid=101)
    tree = ProcessTree([100], proc_root=str(proc.root))
    tree.sample()
    proc.remove(101)
    proc.add(102, ppid=1)  # re-parented to init when the launcher died
    assert list(by_pid(tree.sample())) == [100, 102]
    proc.add(300)
    tree.set_roots([300])
    assert list(by_pid(tree.sample())) == [300]


@pytest.mark.unit
def test_gpu_processes_host_namespace(proc: FakeProc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "otel_gpu.procs")
    proc.add(100)
    proc.add(101, ppid=100, nspid=(101, 7))  # the job runs in a container: vpid 7
    proc.add(500, ppid=1, uid=0, comm="vllm", cmdline=("vllm", "serve"))  # another tenant
    tree = ProcessTree([100], proc_root=str(proc.root))
    assert tree.sees_host_pids()
    reading = tree.sample([101, 500, 999, 7])
    procs = by_pid(reading)
    assert reading.host_to_local == {101: 101, 500: 500}
    assert procs[101].in_tree and procs[101].vpid == 7
    assert not procs[500].in_tree and procs[500].command == "vllm serve"
    # Host PIDs that are not visible have exited (7 is not 101's inner PID: NVML gives host PIDs).
    assert reading.unmapped_gpu_pids == (999, 7)  # and no namespace warning on the host
    assert caplog.records == []


@pytest.mark.unit
def test_gpu_processes_container_without_host_pids(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "otel_gpu.procs")
    proc = FakeProc(tmp_path / "proc", host_namespace=False)
    proc.add(1, ppid=0, comm="tini", cmdline=("tini",))
    proc.add(7, ppid=1, fds=("/dev/null", "/dev/nvidiactl", "/dev/nvidia0"))
    proc.add(8, ppid=1)  # no GPU device open: PID 8 from NVML is somebody else on the host
    proc.add(40, ppid=1, nspid=(40, 3))  # a nested namespace: PID 3 inside
    tree = ProcessTree([1], proc_root=str(proc.root))
    assert not tree.sees_host_pids()
    reading = tree.sample([7, 8, 3, 51234])
    assert reading.host_to_local == {7: 7, 3: 40}
    assert reading.unmapped_gpu_pids == (8, 51234)
    tree.sample([7, 8, 3, 51234])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # once, not per sample
    assert "8, 51234" in warnings[0]
    for fix in ("hostPID: true", "--pid=host", "OTEL_GPU_PROC_ROOT"):
        assert fix in warnings[0]


@pytest.mark.unit
def test_roots_translated_into_a_mounted_host_proc(proc: FakeProc) -> None:
    """The agent in a container, reading the host's /proc through OTEL_GPU_PROC_ROOT."""
    me = os.getpid()
    with open(f"/proc/{me}/stat", "rb") as f:
        my_start = int(f.read().rsplit(b")", 1)[1].split()[19])
    proc.add(me, starttime=my_start + 1)  # some host process that has our container PID
    proc.add(4242, ppid=900, starttime=my_start, nspid=(4242, me))  # us, as the host sees us
    proc.add(4243, ppid=4242, nspid=(4243, 12))
    tree = ProcessTree([me], proc_root=str(proc.root))
    procs = by_pid(tree.sample())
    assert list(procs) == [4242, 4243]
    assert (procs[4242].vpid, procs[4243].vpid) == (me, 12)


@pytest.mark.unit
def test_cap_prioritizes_roots_and_gpu_processes(proc: FakeProc) -> None:
    proc.add(100)
    for pid in range(101, 111):
        proc.add(pid, ppid=100)
    proc.add(500, ppid=1)
    tree = ProcessTree([100], proc_root=str(proc.root), max_processes=4)
    reading = tree.sample([109, 500])
    assert list(by_pid(reading)) == [100, 109, 500, 101]
    assert reading.dropped == 8  # 11 in the tree + 1 GPU process outside it - 4
    # A tracked process keeps its place when a newcomer would sort first (series don't flap).
    proc.add(50, ppid=100)
    reading = tree.sample([109, 500])
    assert list(by_pid(reading)) == [100, 109, 500, 101] and reading.dropped == 9
    assert len(tree.job_pids()) == 12  # job_pids is not capped


@pytest.mark.unit
def test_command_redaction_and_truncation(proc: FakeProc) -> None:
    argv = (
        "python3",
        "train.py",
        "--hf_token",
        "hf_AbCdEf",
        "--api-key=sk-123",
        "--push_to",
        "https://bob:pw123@hub.example.com/x",
        "--lr",
        "1e-4",
    )
    cmd = redact_command(list(argv))
    for secret in ("hf_AbCdEf", "sk-123", "pw123", "bob"):
        assert secret not in cmd
    assert cmd.startswith("python3 train.py --hf_token *** --api-key=*** --push_to https://")
    assert cmd.endswith("--lr 1e-4")
    proc.add(100, cmdline=argv)
    short = by_pid(ProcessTree([100], proc_root=str(proc.root), command_max_len=20).sample())
    assert short[100].command == "python3 train.py --h"


@pytest.mark.unit
def test_missing_proc_root_is_empty(tmp_path: Path) -> None:
    tree = ProcessTree([1], proc_root=str(tmp_path / "nope"))
    assert tree.sample([5]).processes == () and tree.job_pids() == []


# -- real processes ----------------------------------------------------------------------------

PARENT = """
import subprocess, sys, time
kids = [subprocess.Popen(["sleep", "60"]) for _ in range(int(sys.argv[1]))]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def start_parent(spawned: list[subprocess.Popen], n: int) -> tuple[subprocess.Popen, list[int]]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(n)], stdout=subprocess.PIPE, start_new_session=True
    )
    spawned.append(parent)
    assert parent.stdout is not None
    kids = [int(x) for x in parent.stdout.readline().split()]
    return parent, kids


@pytest.mark.process
def test_real_tree_exit_zombie_and_orphans(spawned: list[subprocess.Popen]) -> None:
    parent, kids = start_parent(spawned, 2)
    tree = ProcessTree([parent.pid])
    deadline = time.monotonic() + 5
    while True:  # right after exec a child may not have touched a page yet
        procs = by_pid(tree.sample())
        if time.monotonic() > deadline or all(procs[k].memory_rss for k in kids):
            break
        time.sleep(0.02)
    assert set(procs) == {parent.pid, *kids}
    me = pwd.getpwuid(os.getuid()).pw_name
    for kid in kids:
        s = procs[kid]
        assert (s.executable_name, s.parent_pid, s.owner) == ("sleep", parent.pid, me)
        assert s.command == "sleep 60" and s.in_tree
        assert s.memory_rss and s.memory_virtual and s.thread_count == 1 and s.fd_count
        assert s.create_time is not None and abs(s.create_time - time.time()) < 120
    # One child exits; its parent doesn't reap it: a zombie without memory figures.
    os.kill(kids[0], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and by_pid(tree.sample())[kids[0]].memory_rss is not None:
        time.sleep(0.02)
    assert by_pid(tree.sample())[kids[0]].memory_rss is None
    # The parent dies: the zombie goes (init reaps it), the live orphan stays in the job.
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and kids[0] in by_pid(tree.sample()):
        time.sleep(0.02)
    procs = by_pid(tree.sample())
    assert list(procs) == [kids[1]] and procs[kids[1]].parent_pid != parent.pid
    os.kill(kids[1], signal.SIGKILL)


@pytest.mark.process
def test_real_busy_child_uses_cpu(spawned: list[subprocess.Popen]) -> None:
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.time() + 30\nwhile time.time() < end: pass",
        ],
        start_new_session=True,
    )
    spawned.append(busy)
    idle = subprocess.Popen(["sleep", "30"], start_new_session=True)
    spawned.append(idle)
    tree = ProcessTree([busy.pid, idle.pid])
    tree.sample()
    time.sleep(1.0)
    procs = by_pid(tree.sample())
    cpus = len(os.sched_getaffinity(0))
    assert procs[busy.pid].cpu_utilization is not None
    assert procs[busy.pid].cpu_utilization > 0.05 / cpus  # busy even on a crowded machine
    assert procs[idle.pid].cpu_utilization == pytest.approx(0.0, abs=0.02 / cpus)


@pytest.mark.process
def test_real_cap_and_gpu_process_outside_tree(spawned: list[subprocess.Popen]) -> None:
    parent, kids = start_parent(spawned, 8)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    spawned.append(other)
    tree = ProcessTree([parent.pid], max_processes=4, host_pid_namespace=True)
    reading = tree.sample([other.pid])
    procs = by_pid(reading)
    assert list(procs)[:2] == [parent.pid, other.pid]
    assert len(procs) == 4 and reading.dropped == 6  # 9 in the tree + 1 outside - 4
    assert not procs[other.pid].in_tree and procs[other.pid].executable_name == "sleep"
    assert reading.host_to_local == {other.pid: other.pid}
    assert sorted(tree.job_pids()) == sorted([parent.pid, *kids])


@pytest.mark.process
def test_real_exec_of_the_same_program(spawned: list[subprocess.Popen]) -> None:
    """python -> exec python: same comm, so only re-reading young processes catches it."""
    code = (
        "import os, sys, time; time.sleep(0.4); "
        "os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', 'second'])"
    )
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    spawned.append(child)
    tree = ProcessTree([child.pid])
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        first = by_pid(tree.sample())[child.pid].command
        if first:
            break
        time.sleep(0.02)
    assert first is not None and not first.endswith("second")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        command = by_pid(tree.sample())[child.pid].command
        if command and command.endswith("second"):
            break
        time.sleep(0.05)
    assert command is not None and command.endswith("second")


@pytest.mark.process
def test_fd_count_of_a_real_process_matches_its_fd_directory() -> None:
    """On procfs the count comes from stat(/proc/PID/fd).st_size where the kernel provides it
    (Linux 6.2+), else from listing the directory; both must give the process's open files."""
    import subprocess
    import sys

    code = "import os, time; fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(7)]; print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        sample = by_pid(ProcessTree([child.pid]).sample())[child.pid]
        assert sample.fd_count == len(os.listdir(f"/proc/{child.pid}/fd"))
        assert sample.fd_count is not None and sample.fd_count >= 10  # stdio + pipe + the 7
    finally:
        child.kill()
        child.wait()


@pytest.mark.unit
def test_between_discovery_scans_only_the_known_tree_is_read(proc: FakeProc) -> None:
    """With a discovery period, a new child is found at the next full scan, while a member
    that exits disappears at once and the known members keep reporting every sweep."""
    clock = Clock()
    proc.add(100)
    proc.add(101, ppid=100)
    tree = ProcessTree([100], proc_root=str(proc.root), clock=clock, discovery_period_s=5.0)
    assert list(by_pid(tree.sample())) == [100, 101]
    proc.add(102, ppid=100)  # a new worker
    proc.remove(101)  # an exited one
    clock.t += 1
    assert list(by_pid(tree.sample())) == [100]  # 102 not yet discovered, 101 gone at once
    clock.t += 4
    assert list(by_pid(tree.sample())) == [100, 102]  # found within the period


@pytest.mark.unit
def test_open_files_are_counted_at_scans_and_for_new_processes(proc: FakeProc) -> None:
    """The fd count (slow-changing, one syscall per process) is refreshed with each discovery
    scan; between scans the last count is reported, and a process new to the sample is counted
    at once."""
    clock = Clock()
    proc.add(100, fds=("/dev/null",))
    tree = ProcessTree(
        [100], proc_root=str(proc.root), clock=clock, discovery_period_s=5.0, cpu_count=1
    )
    assert by_pid(tree.sample())[100].fd_count == 1
    proc.add(100, fds=("/dev/null", "pipe:[1]", "pipe:[2]"))  # opened two more
    clock.t += 1
    assert by_pid(tree.sample())[100].fd_count == 1  # between scans: the last count
    clock.t += 4
    assert by_pid(tree.sample())[100].fd_count == 3  # the scan counts again


def _sample_as_nobody(pid: int) -> dict:
    """Sample ``pid`` from a forked child that dropped root for the unprivileged ``nobody``
    user (the suite runs as root, which no permission check ever denies)."""
    import json

    ProcessTree([pid]).sample()  # import lazily loaded codecs while stdlib is still readable
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            denied = {}
            for what, probe in (("exe", os.readlink), ("fd", os.listdir)):
                try:
                    probe(f"/proc/{pid}/{what}")
                    denied[what] = False
                except PermissionError:
                    denied[what] = True
            sample = by_pid(ProcessTree([pid]).sample())[pid]
            out = {"denied": denied, **sample._asdict()}
        except BaseException as exc:
            out = {"error": repr(exc)}
        os.write(write_end, json.dumps(out).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as f:
        return json.loads(f.read())


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to the nobody user")
def test_process_of_another_user_is_sampled_with_what_is_readable() -> None:
    """AccessDenied: an unprivileged agent watching another user's process may not read its
    exe link or list its open files. It reports the rest, falls back to comm for the name and
    reports the fd count only where the kernel gives it without that permission."""
    from otel_gpu.sampling.procs import fd_count_by_stat

    child = subprocess.Popen(["sleep", "30"])
    try:
        got = _sample_as_nobody(child.pid)
        assert "error" not in got, got
        assert got["denied"] == {"exe": True, "fd": True}  # the denial really happened
        assert got["executable_name"] == "sleep"  # from comm: the exe link was denied
        assert got["command"] == "sleep 30" and got["owner"] == "root"
        assert got["memory_rss"] and got["memory_virtual"] and got["thread_count"] == 1
        true_count = len(os.listdir(f"/proc/{child.pid}/fd"))
        # stat(/proc/PID/fd).st_size needs no ptrace access; listing the directory does
        assert got["fd_count"] == (true_count if fd_count_by_stat("/proc") else None)
    finally:
        child.kill()
        child.wait()


@pytest.mark.unit
def test_discovery_scan_skipped_while_no_process_was_created(proc: FakeProc) -> None:
    """When loadavg's newest PID has not moved since the last scan, nothing new can be in the
    tree: the scan is skipped (open files are still recounted). Once it moves, the next due
    scan finds the new process."""
    clock = Clock()
    (proc.root / "loadavg").write_text("0.50 0.40 0.30 1/120 500\n")
    proc.add(100, fds=("/dev/null",))
    tree = ProcessTree(
        [100],
        proc_root=str(proc.root),
        agent_proc_root=str(proc.root),  # loadavg speaks for this namespace
        clock=clock,
        discovery_period_s=5.0,
    )
    assert list(by_pid(tree.sample())) == [100]
    # A process appears without the newest PID moving: impossible on a real kernel, which is
    # what shows that the scan was skipped.
    proc.add(101, ppid=100)
    proc.add(100, fds=("/dev/null", "pipe:[1]"))
    clock.t += 5
    procs = by_pid(tree.sample())
    assert list(procs) == [100] and procs[100].fd_count == 2  # no scan; fds still recounted
    (proc.root / "loadavg").write_text("0.50 0.40 0.30 1/121 501\n")
    clock.t += 1
    assert list(by_pid(tree.sample())) == [100]  # not due yet
    clock.t += 4
    assert list(by_pid(tree.sample())) == [100, 101]


@pytest.mark.process
def test_real_new_child_is_found_at_the_next_discovery(spawned: list[subprocess.Popen]) -> None:
    """On the real /proc a fork moves loadavg's newest PID, so a child started after the first
    scan is found within the discovery period."""
    code = (
        "import subprocess, sys, time\n"
        "sys.stdin.readline()\n"
        "kid = subprocess.Popen(['sleep', '60'])\n"
        "print(kid.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    spawned.append(parent)
    tree = ProcessTree([parent.pid], discovery_period_s=0.3)
    assert list(by_pid(tree.sample())) == [parent.pid]
    time.sleep(0.35)
    assert list(by_pid(tree.sample())) == [parent.pid]  # a due scan, skipped or not: no child
    assert parent.stdin is not None and parent.stdout is not None
    parent.stdin.write("go\n")
    parent.stdin.flush()
    kid = int(parent.stdout.readline())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and kid not in by_pid(tree.sample()):
        time.sleep(0.05)
    assert kid in by_pid(tree.sample())
