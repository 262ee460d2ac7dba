"""The watched job's process tree, read straight from ``/proc``.

One :meth:`ProcessTree.sample` reads ``/proc/PID/stat`` of every visible process once (the parent
map, and for the tracked ones also CPU time, memory, threads: reading the files directly is about
twice as fast as ``psutil``'s ``oneshot()``). What never changes for a process (executable name,
command, owner, PID namespaces) is read once and cached under ``(pid, starttime)``, so a reused
PID is never mistaken for the process that held it before.

NVML reports host PIDs. They are mapped to PIDs of the ``/proc`` this tree reads (its
``proc_root``), in this order:

1. identity, when ``proc_root`` shows the host PID namespace (kernel threads such as
   ``kthreadd`` are visible only there) and the PID is visible;
2. identity, when the visible process with that PID holds a ``/dev/nvidia*`` device open (the same
   process NVML sees, e.g. a driver that reports PIDs of the caller's namespace);
3. when ``proc_root`` is not the host's: the one visible process whose ``NSpid:`` line lists
   the PID in an inner namespace level (nested containers);
4. otherwise unmapped: reported in :attr:`ProcessReading.unmapped_gpu_pids`, with one warning
   that explains the fix.
"""

from __future__ import annotations

import logging
import math
import os
import pwd
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from otel_gpu.core.redact import COMMAND_MODES, COMMAND_REDACTED, command_attribute, command_name
from otel_gpu.sampling.procfs import (
    CLK_TCK,
    PAGE_SIZE,
    ProcStat,
    read_boot_time,
    read_cmdline,
    read_stat,
    read_status,
)
from otel_gpu.sampling.snapshot import ProcessSample

__all__ = ["UNMAPPED_FIX", "ProcessReading", "ProcessTree"]

log = logging.getLogger("otel_gpu.procs")

EXEC_GRACE_S = 2.0  # a process younger than this may still exec() into another program

UNMAPPED_FIX = (
    "run the agent in the host PID namespace (`hostPID: true` in Kubernetes, `--pid=host` in "
    "Docker), or mount the host's /proc and point OTEL_GPU_PROC_ROOT at it"
)


@dataclass(frozen=True)
class ProcessReading:
    """What one :meth:`ProcessTree.sample` saw."""

    processes: tuple[ProcessSample, ...]
    dropped: int  # tree or GPU processes left out because of ``max_processes``
    unmapped_gpu_pids: tuple[int, ...]  # NVML (host) PIDs that match no visible process
    host_to_local: dict[int, int] = field(default_factory=dict)  # NVML PID -> PID in proc_root


@dataclass(slots=True)
class _Static:
    """Per-process facts that never change, cached under (pid, starttime)."""

    comm: bytes  # from stat, undecoded; exec changes it
    create_time: float | None  # s since epoch
    executable_name: str | None
    command: str | None
    owner: str | None
    vpid: int | None
    young: bool = False  # read in the process's first moments: read again next time
    command_known: bool = True  # False: an empty command line (mid-exec), read again next time
    command_name: str | None = None  # argv[0] (process.command)


def fd_count_by_stat(proc_root: str) -> bool:
    """True when ``stat(/proc/PID/fd).st_size`` is the number of open files (procfs on Linux
    6.2 and newer): one syscall instead of listing the directory. Checked on our own process,
    whose fd table is never empty (stdin/stdout/stderr or the interpreter's own files)."""
    try:
        return os.stat(f"{proc_root}/self/fd").st_size > 0
    except OSError:
        return False


class ProcessTree:
    """The watched roots and all their descendants, sampled from ``proc_root``.

    ``sample`` runs only on the sampler thread; ``set_roots`` and ``job_pids`` may be called
    from any thread. A process that was once in the tree stays in it when its
    parent exits and it is re-parented (a launcher that dies leaves its trainer in the job).
    """

    def __init__(
        self,
        root_pids: Iterable[int] = (),
        *,
        proc_root: str = "/proc",
        max_processes: int = 256,
        command_max_len: int = 256,
        cpu_count: int | None = None,
        host_pid_namespace: bool | None = None,
        agent_proc_root: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        discovery_period_s: float = 0.0,
        skip_pids: Iterable[int] = (),
        command_mode: str = COMMAND_REDACTED,
    ) -> None:
        """``root_pids`` are PIDs as the agent sees them (in ``agent_proc_root``); when
        ``proc_root`` is another namespace's /proc (the host's, mounted into a container) they
        are translated to it. ``cpu_count``: CPUs available (default: the agent's affinity set),
        the denominator of ``cpu_utilization``. ``host_pid_namespace``: whether ``proc_root``
        shows host PIDs (default: detected from visible kernel threads). ``skip_pids``: PIDs
        never read (an earlier sampler hung reading them). ``command_mode``
        (``OTEL_GPU_PROCESS_COMMAND``): ``process.command_line`` is the command line with
        credentials masked (``redacted``), the program only (``executable``) or absent
        (``off``), and ``process.command`` is ``argv[0]`` in every mode; see
        :mod:`otel_gpu.core.redact`."""
        if max_processes < 1:
            raise ValueError("max_processes must be >= 1")
        if command_mode not in COMMAND_MODES:
            raise ValueError(f"command_mode must be one of {', '.join(COMMAND_MODES)}")
        self.command_mode = command_mode
        self.proc_root = proc_root
        self.max_processes = max_processes
        self.command_max_len = command_max_len
        self.agent_proc_root = agent_proc_root
        self._cpus = cpu_count or len(os.sched_getaffinity(0)) or 1
        self._host_ns = host_pid_namespace
        self._clock = clock
        self._lock = threading.Lock()
        self._roots: list[tuple[int, int | None]] = []  # (pid, starttime when set)
        self._reset = False
        self._members: set[tuple[int, int]] = set()  # keys in the tree as of the last sample
        self._tracked: set[tuple[int, int]] = set()  # keys sampled last time (cap stickiness)
        self._job_pids: list[int] = []
        self._static: dict[tuple[int, int], _Static] = {}
        self._nspid: dict[tuple[int, int], tuple[int, ...]] = {}
        self._nvidia: dict[tuple[int, int], bool] = {}
        self._cpu_prev: dict[tuple[int, int], tuple[int, float, int]] = {}  # ticks, at, system
        self._fds: dict[tuple[int, int], int | None] = {}  # open files, refreshed on scans
        self._users: dict[int, str] = {}
        self._boot_time: float | None = None
        self._warned_unmapped = False
        self._fd_by_stat = fd_count_by_stat(proc_root)
        self._skip = frozenset(skip_pids)
        # The PID whose /proc files are being read (None between processes): a sampler whose
        # sweep hangs reports it, and the next one skips that PID.
        self.reading_pid: int | None = None
        # New descendants are found by reading every process's stat; between those scans (at
        # most discovery_period_s apart) only the known tree and the GPU processes are read, so
        # a 1 s sampler on a busy host does not pay for the whole host every second.
        self.discovery_period_s = discovery_period_s
        self._last_scan = -math.inf
        self._scan_newest: bytes | None = None  # loadavg's newest PID when we last scanned
        # loadavg describes the reader's own PID namespace: usable only when proc_root is it.
        self._loadavg = (
            f"{proc_root}/loadavg"
            if os.path.realpath(proc_root) == os.path.realpath(agent_proc_root)
            else None
        )
        self.set_roots(root_pids)

    # -- public API -------------------------------------------------------------------------

    def set_roots(self, pids: Iterable[int]) -> None:
        """Watch these PIDs (as the agent sees them) and their descendants from now on."""
        roots = []
        for pid in dict.fromkeys(int(p) for p in pids):
            local = self._from_agent_pid(pid)
            if local in self._skip:
                continue
            self.reading_pid = local
            st = read_stat(self.proc_root, local)
            roots.append((local, st.starttime if st is not None else None))
        self.reading_pid = None
        with self._lock:
            self._roots = roots
            self._reset = True  # forget the previous tree's members

    def _from_agent_pid(self, pid: int) -> int:
        """``proc_root``'s PID for a PID of the agent's own namespace (``agent_proc_root``).

        They differ when ``proc_root`` is the host's /proc mounted into the agent's container:
        the same process has the same start time in both, and its innermost ``NSpid:`` level
        is the agent-side PID. Without a unique match the PID is taken as given.
        """
        if os.path.realpath(self.proc_root) == os.path.realpath(self.agent_proc_root):
            return pid
        mine = read_stat(self.agent_proc_root, pid)
        if mine is None:
            return pid
        matches = [
            local
            for local, st in self._scan().items()
            if st.starttime == mine.starttime
            and len(ns := read_status(self.proc_root, local)[1]) > 1
            and ns[-1] == pid
        ]
        return matches[0] if len(matches) == 1 else pid

    def job_pids(self) -> list[int]:
        """Live PIDs of the watched tree (roots first) as of the last sample, uncapped."""
        return list(self._job_pids)

    def sample(self, gpu_pids: Iterable[int] = ()) -> ProcessReading:
        """Read the tree (and the GPU processes NVML listed, by host PID) once."""
        now = self._clock()
        gpu_pids = list(dict.fromkeys(gpu_pids))
        due = (
            self._reset
            or now - self._last_scan >= self.discovery_period_s
            or not self.sees_host_pids()
        )
        stats = None
        if due:
            self._last_scan = now
            # No process or thread created in this PID namespace since the last scan (the
            # newest PID in loadavg is unchanged): no new descendant can exist, skip the scan.
            newest = self._newest_pid()
            if newest is None or newest != self._scan_newest or self._reset:
                stats = self._scan()
                self._scan_newest = newest
        if stats is None:
            stats = self._read_known(gpu_pids)
        with self._lock:
            roots = [
                pid
                for pid, start in self._roots
                if pid in stats and stats[pid].starttime == start and stats[pid].state != "X"
            ]
            if self._reset:
                self._reset = False
                self._members = set()
        members = self._walk(stats, roots)
        host_to_local, unmapped = self._map_gpu_pids(stats, gpu_pids)

        # Priority under the cap: roots, GPU processes, those tracked last time (so series
        # don't flap), then the rest of the tree nearest the roots first.
        first = [*roots, *host_to_local.values()]
        if len(members) + len(first) > self.max_processes:
            first += [p for p in members if (p, stats[p].starttime) in self._tracked]
        candidates = list(dict.fromkeys(first + members))
        chosen = candidates[: self.max_processes]
        dropped = len(candidates) - len(chosen)
        member_set = set(members)
        samples = []
        for pid in chosen:
            self.reading_pid = pid
            sample = self._sample_one(pid, stats[pid], now, pid in member_set, due)
            if sample is not None:
                samples.append(sample)
        self.reading_pid = None

        self._members = {(p, stats[p].starttime) for p in members}
        self._tracked = {(s.pid, stats[s.pid].starttime) for s in samples}
        self._job_pids = members
        if due or len(self._static) > len(samples) or len(self._cpu_prev) > len(samples):
            self._prune({(pid, st.starttime) for pid, st in stats.items()})
        return ProcessReading(tuple(samples), dropped, tuple(unmapped), host_to_local)

    # -- the tree ---------------------------------------------------------------------------

    def _scan(self) -> dict[int, ProcStat]:
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            return {}
        return self._stats_of(int(name) for name in names if name.isdigit())

    def _newest_pid(self) -> bytes | None:
        """The most recently created PID of this namespace (last field of loadavg), if known."""
        if self._loadavg is None or not self.sees_host_pids():
            return None
        try:
            fd = os.open(self._loadavg, os.O_RDONLY)
            try:
                fields = os.read(fd, 256).split()
            finally:
                os.close(fd)
        except OSError:
            return None
        return fields[-1] if len(fields) == 5 else None

    def _read_known(self, gpu_pids: list[int]) -> dict[int, ProcStat]:
        """Stats of the tree as last seen, the roots and the GPU processes only."""
        with self._lock:
            wanted = [pid for pid, _start in self._roots]
        wanted += [pid for pid, _start in self._members]
        wanted += gpu_pids
        return self._stats_of(dict.fromkeys(wanted))

    def _stats_of(self, pids: Iterable[int]) -> dict[int, ProcStat]:
        """The stats of ``pids`` that still exist, less the skipped ones (``reading_pid`` says
        which one is being read)."""
        stats: dict[int, ProcStat] = {}
        skip = self._skip
        for pid in pids:
            if pid in skip:
                continue
            self.reading_pid = pid
            st = read_stat(self.proc_root, pid)
            if st is not None:
                stats[pid] = st
        self.reading_pid = None
        return stats

    def _walk(self, stats: dict[int, ProcStat], roots: list[int]) -> list[int]:
        children: dict[int, list[int]] = {}
        for pid, st in stats.items():
            children.setdefault(st.ppid, []).append(pid)
        # Earlier members whose parent exited stay in the tree (same pid and starttime).
        sticky = sorted(
            p for p, start in self._members if p in stats and stats[p].starttime == start
        )
        order = list(dict.fromkeys(roots + sticky))
        seen = set(order)
        i = 0
        while i < len(order):
            for child in sorted(children.get(order[i], ())):
                if child not in seen:
                    seen.add(child)
                    order.append(child)
            i += 1
        return [p for p in order if stats[p].state != "X"]

    # -- NVML PID mapping -------------------------------------------------------------------

    def _map_gpu_pids(
        self, stats: dict[int, ProcStat], gpu_pids: Iterable[int]
    ) -> tuple[dict[int, int], list[int]]:
        mapped: dict[int, int] = {}
        pending: list[int] = []
        host_ns = self.sees_host_pids()
        for hpid in dict.fromkeys(int(p) for p in gpu_pids):
            if hpid in stats and (host_ns or self._holds_nvidia(hpid, stats[hpid].starttime)):
                mapped[hpid] = hpid
            else:
                pending.append(hpid)
        unmapped: list[int] = []
        if pending and host_ns:
            unmapped = pending  # host PIDs that are not visible have exited
        elif pending:
            inner: dict[int, list[int]] = {}  # PID in an inner namespace -> local PIDs
            for pid, st in stats.items():
                for level_pid in self._ns_pids(pid, st.starttime)[1:]:
                    inner.setdefault(level_pid, []).append(pid)
            for hpid in pending:
                found = inner.get(hpid, [])
                if len(found) == 1:
                    mapped[hpid] = found[0]
                else:
                    unmapped.append(hpid)
        if unmapped and not host_ns and not self._warned_unmapped:
            self._warned_unmapped = True
            log.warning(
                "NVML lists GPU processes (host PIDs %s) that are not visible in %s: the agent "
                "runs in another PID namespace, so their GPU memory is reported under the host "
                "PID without process details. Fix: %s.",
                ", ".join(map(str, unmapped[:8])),
                self.proc_root,
                UNMAPPED_FIX,
            )
        return mapped, unmapped

    def sees_host_pids(self) -> bool:
        """Whether ``proc_root`` shows the host PID namespace (cached after the first answer)."""
        if self._host_ns is None:
            # Kernel threads (kthreadd is PID 2, parent 0) exist only in the initial namespace.
            st = read_stat(self.proc_root, 2)
            self._host_ns = st is not None and st.ppid == 0 and st.comm == "kthreadd"
        return self._host_ns

    def _holds_nvidia(self, pid: int, start: int) -> bool:
        key = (pid, start)
        if key not in self._nvidia:
            self.reading_pid = pid
            found = False
            fd_dir = f"{self.proc_root}/{pid}/fd"
            try:
                for fd in os.listdir(fd_dir):
                    if os.readlink(f"{fd_dir}/{fd}").startswith("/dev/nvidia"):
                        found = True
                        break
            except OSError:
                pass
            self._nvidia[key] = found
        return self._nvidia[key]

    def _ns_pids(self, pid: int, start: int) -> tuple[int, ...]:
        key = (pid, start)
        ns = self._nspid.get(key)
        if ns is None:
            self.reading_pid = pid
            ns = read_status(self.proc_root, pid)[1]
            self._nspid[key] = ns
        return ns

    # -- one process ------------------------------------------------------------------------

    def _sample_one(
        self, pid: int, st: ProcStat, now: float, in_tree: bool, refresh_fds: bool
    ) -> ProcessSample | None:
        key = (pid, st.starttime)
        static = self._static.get(key)
        # exec() keeps pid and start time: a changed comm, or a process caught in its first
        # moments (between fork and exec), means the cached command may be stale.
        if static is None or static.young or static.comm != st.comm_raw:
            static = self._read_static(pid, st)
            if static is None:
                return None  # exited while we read it
            created = static.create_time
            static.young = created is not None and time.time() - created < EXEC_GRACE_S
            if static.command_known or st.state == "Z":  # empty: mid-exec, ask again
                self._static[key] = static
        if st.state == "Z":  # a zombie has released its memory and files: unknown, not 0
            return ProcessSample(
                pid, static.vpid, st.ppid, static.executable_name, static.command, static.owner,
                static.create_time, None, None, None, None, None, in_tree, st.starttime, None,
                static.command_name,
            )  # fmt: skip
        # Open files change slowly: counted once per discovery period and for processes new
        # to the sample.
        if refresh_fds or key not in self._fds:
            try:
                fd_dir = f"{self.proc_root}/{pid}/fd"
                self._fds[key] = (
                    os.stat(fd_dir).st_size if self._fd_by_stat else len(os.listdir(fd_dir))
                )
            except PermissionError:
                self._fds[key] = None
            except OSError:
                return None  # exited since the scan
        fd_count = self._fds[key]
        ticks, system, threads, vsize, rss_pages = st.usage()
        cpu: float | None = None
        cpu_system: float | None = None
        prev = self._cpu_prev.get(key)
        if prev is None or now > prev[1]:
            if prev is not None:
                per_s = 1.0 / CLK_TCK / (now - prev[1]) / self._cpus
                cpu = min(1.0, max(0.0, (ticks - prev[0]) * per_s))
                cpu_system = min(cpu, max(0.0, (system - prev[2]) * per_s))
            self._cpu_prev[key] = (ticks, now, system)
        return ProcessSample(
            pid, static.vpid, st.ppid, static.executable_name, static.command, static.owner,
            static.create_time, cpu, rss_pages * PAGE_SIZE, vsize, threads, fd_count, in_tree,
            st.starttime, cpu_system, static.command_name,
        )  # fmt: skip

    def _read_static(self, pid: int, st: ProcStat) -> _Static | None:
        base = f"{self.proc_root}/{pid}"
        args = read_cmdline(self.proc_root, pid, max(4096, self.command_max_len * 4))
        if args is None:
            return None  # exited
        # Redacted before it is cut, so a cut never exposes part of a secret.
        command = command_attribute(args, self.command_mode, self.command_max_len)
        name = command_name(args, self.command_max_len)
        known = bool(args)
        try:
            exe = os.path.basename(os.readlink(f"{base}/exe")).removesuffix(" (deleted)")
        except OSError:  # other users' processes, kernel threads, zombies
            exe = ""
        uid, ns = read_status(self.proc_root, pid)
        self._nspid[(pid, st.starttime)] = ns
        vpid = ns[-1] if len(ns) > 1 and ns[-1] != pid else None
        return _Static(
            st.comm_raw,
            self._create_time(st.starttime),
            exe or st.comm or None,
            command,
            self._user(uid),
            vpid,
            command_known=known,
            command_name=name,
        )

    def _user(self, uid: int | None) -> str | None:
        if uid is None:
            return None
        name = self._users.get(uid)
        if name is None:
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:  # no passwd entry (common in containers): report the number
                name = str(uid)
            self._users[uid] = name
        return name

    def _create_time(self, starttime: int) -> float | None:
        if self._boot_time is None:
            self._boot_time = read_boot_time(self.proc_root)
            if self._boot_time is None:
                return None
        return self._boot_time + starttime / CLK_TCK

    def _prune(self, live: set[tuple[int, int]]) -> None:
        for cache in (self._static, self._cpu_prev, self._nvidia, self._fds):
            for key in [k for k in cache if k not in live]:
                del cache[key]
        if len(self._nspid) > 2 * len(live) + 64:
            self._nspid = {k: v for k, v in self._nspid.items() if k in live}
