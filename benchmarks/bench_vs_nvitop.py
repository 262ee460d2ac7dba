"""The whole agent beside nvitop-exporter, CPU and memory measured from outside.

    python benchmarks/bench_vs_nvitop.py [--seconds 30,60] [--venv DIR] [--profile DIR]

Setup: the fake libnvidia-ml with 8 GPUs x 64 GPU processes (64 real, sleeping child
processes, eight per GPU). Ours: ``otel-gpu run --interval 1 --export-interval 5`` launching
the job that owns those 64 processes, exporting OTLP gRPC to a sink on 127.0.0.1, detection on,
``--quiet`` (no live view: the peer draws nothing either; the view's own cost is measured by
bench_view.py): the wrapper process plus its sampling helper process are measured (not the job). The peer:
``nvitop-exporter --interval 1`` (installed by this script into its own virtualenv, cached in
``--venv``), reading the same fake and the same processes, scraped over HTTP every 5 s.

Both run at the same time in each measured window, so host noise (this is a shared 2-core VM)
falls on both alike; each window starts after a 10 s warm-up that keeps start-up imports out.
CPU is utime + stime from ``/proc/PID/stat`` at the window's ends; memory is the RSS summed over
the measured processes at the end. Prints one row per window and ends with one JSON line
{"name", "value", "baseline", "ratio", "unit"} for the longest window.

``--profile DIR``: ``py-spy record`` (100 Hz, non-blocking) on the wrapper and on the helper
during each window, the collapsed stacks written to DIR, the top frames by own and by inclusive
samples printed per process. Profiling adds its own cost: the CPU figures of a profiled run are
not the ones to quote.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_sample_cycle import GPUS, PROCS, scenario  # noqa: E402
from support.otlp_sink import OtlpSink  # noqa: E402

from tests.fakenvml.build import build_fake  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
WARMUP_S = 10.0
SCRAPE_EVERY_S = 5.0

# The job: 64 sleeping children (the GPU processes), their PIDs on stdout, then wait.
JOB = f"""
import os, sys, time
kids = []
for _ in range({PROCS}):
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    kids.append(pid)
print(" ".join(map(str, kids)), flush=True)
time.sleep(3600)
"""


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def children(pid: int) -> list[int]:
    """Child processes of every thread of ``pid`` (each thread's list is its own)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def nvitop_venv(path: Path) -> Path:
    exe = path / "bin" / "nvitop-exporter"
    if not exe.exists():
        print(f"installing nvitop-exporter into {path} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run(
            [str(path / "bin" / "pip"), "install", "-q", "nvitop-exporter"],
            check=True,
        )
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
    print(f"peer: {version.strip()}", flush=True)
    return exe


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Window:
    """CPU ticks of a set of processes between two instants."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.c0 = sum(cpu_ticks(p) for p in pids)

    def end(self) -> tuple[float, int]:
        """(CPU seconds per wall second, RSS bytes now)."""
        cpu = sum(cpu_ticks(p) for p in self.pids) - self.c0
        wall = time.monotonic() - self.t0
        return cpu / CLK_TCK / wall, sum(rss_bytes(p) for p in self.pids)


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """``py-spy record`` on one process for ``seconds``, collapsed stacks to ``out``."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
         "--nonblocking", "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def top_frames(collapsed: Path, most: int = 12) -> list[str]:
    """The frames with the most own samples, and the most inclusive ones, of a raw profile."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")
        ]
        own[frames[-1]] += n
        for f in set(frames[1:]):  # the thread's name is the first entry
            inclusive[f] += n
    if not total:
        return ["(no samples)"]
    rows = [f"  own {100 * n / total:5.1f} %  {f}" for f, n in own.most_common(most)]
    rows += [f"  all {100 * n / total:5.1f} %  {f}" for f, n in inclusive.most_common(most)]
    return [f"{total} samples", *rows]


def measure(
    seconds: float, lib: Path, work: Path, peer: Path, sink: OtlpSink, profile: Path | None = None
) -> dict:
    scen = work / "scenario.txt"
    scen.write_text(scenario([]))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{lib.parent}:{env.get('LD_LIBRARY_PATH', '')}"
    env["FAKE_NVML_SCENARIO"] = str(scen)
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
    env["OTEL_GPU_LOCK_DIR"] = str(work)
    env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
    ours = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "run", "--quiet", "--interval", "1",
         "--export-interval", "5", "--", sys.executable, "-c", JOB],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert ours.stdout is not None
    pids = [int(p) for p in ours.stdout.readline().split()]
    scen.write_text(scenario(pids))  # the fake re-reads it: NVML now lists the 64 processes
    port = free_port()
    theirs = subprocess.Popen(
        [str(peer), "--interval", "1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        time.sleep(WARMUP_S)
        helper = [c for c in children(ours.pid) if "otel_gpu.sampling.worker" in cmdline(c)]
        assert helper, "the sampling helper process is not running"
        spies = []
        if profile is not None:
            for name, pid in (("wrapper", ours.pid), ("helper", helper[0])):
                out = profile / f"{name}-{seconds:.0f}s.txt"
                spies.append((name, out, record(pid, seconds, out)))
        mine = Window([ours.pid, *helper])
        parts = Window([ours.pid]), Window(helper)
        peer_w = Window([theirs.pid, *children(theirs.pid)])
        scraped = 0
        deadline = time.monotonic() + seconds
        before = len(sink.metric_requests)
        while time.monotonic() < deadline:
            time.sleep(min(SCRAPE_EVERY_S, max(0.0, deadline - time.monotonic())))
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                body = r.read()
            scraped += 1
        ours_cpu, ours_rss = mine.end()
        (wrapper_cpu, wrapper_rss), (helper_cpu, helper_rss) = (w.end() for w in parts)
        peer_cpu, peer_rss = peer_w.end()
        for name, out, spy in spies:
            spy.wait(timeout=30)
            print(f"\nprofile of the {name} ({seconds:.0f} s window, {out}):")
            print("\n".join(top_frames(out)) if out.exists() else "  (py-spy wrote nothing)")
        exports = len(sink.metric_requests) - before
        exported = {
            pt.attributes.get("process.pid")
            for pt in sink.points()
            if pt.metric == "process.gpu.memory.usage"
        }
        assert set(pids) <= exported, "otel-gpu did not export every GPU process"
        gpu_lines = body.count(b"\ngpu_utilization")
        assert gpu_lines == GPUS, f"nvitop-exporter sees {gpu_lines} GPUs"
        seen = {p for p in pids if f'pid="{p}"'.encode() in body}
        assert len(seen) == PROCS, f"nvitop-exporter reports {len(seen)} of the GPU processes"
        assert exports >= seconds / 5 - 1, f"only {exports} OTLP exports"
        return {
            "seconds": seconds,
            "ours_cpu": ours_cpu,
            "wrapper": (wrapper_cpu, wrapper_rss),
            "helper": (helper_cpu, helper_rss),
            "peer_cpu": peer_cpu,
            "ours_rss": ours_rss,
            "peer_rss": peer_rss,
            "exports": exports,
            "scrapes": scraped,
        }
    finally:
        theirs.terminate()
        ours.terminate()  # SIGTERM to the wrapper: forwarded to the job's group
        for p in (theirs, ours):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", default="30,60", help="measured window lengths, comma list")
    ap.add_argument(
        "--venv",
        type=Path,
        default=Path(tempfile.gettempdir()) / "otel-gpu-bench-nvitop-venv",
        help="virtualenv for nvitop-exporter (created once)",
    )
    ap.add_argument("--profile", type=Path, help="py-spy the wrapper and helper into this folder")
    args = ap.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    peer = nvitop_venv(args.venv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, OtlpSink() as sink:
        work = Path(tmp)
        lib = build_fake(work / "lib")
        for seconds in (float(s) for s in args.seconds.split(",")):
            rows.append(measure(seconds, lib, work, peer, sink, args.profile))
    print(f"\n{GPUS} GPUs x {PROCS} GPU processes, 1 s sampling, both measured in the same windows")
    print(f"{'window':>8} | {'otel-gpu run':>20} | {'nvitop-exporter':>20} | {'ratio':>6}")
    print(f"{'':>8} | {'% core   RSS MiB':>20} | {'% core   RSS MiB':>20} |")
    for r in rows:
        print(
            f"{r['seconds']:>6.0f} s | {100 * r['ours_cpu']:>6.2f} {r['ours_rss'] / 2**20:>10.0f}"
            f"    | {100 * r['peer_cpu']:>6.2f} {r['peer_rss'] / 2**20:>10.0f}"
            f"    | {r['ours_cpu'] / r['peer_cpu']:>6.2f}"
        )
    for r in rows:
        (wc, wr), (hc, hr) = r["wrapper"], r["helper"]
        print(
            f"{r['seconds']:>6.0f} s   otel-gpu run's wrapper {100 * wc:.2f} % core {wr / 2**20:.0f} MiB,"
            f" sampling helper {100 * hc:.2f} % core {hr / 2**20:.0f} MiB"
        )
    last = rows[-1]
    print(
        json.dumps(
            {
                "name": "agent_vs_nvitop_exporter_cpu",
                "value": round(100 * last["ours_cpu"], 3),
                "baseline": round(100 * last["peer_cpu"], 3),
                "ratio": round(last["ours_cpu"] / last["peer_cpu"], 3),
                "unit": "% of one core",
            }
        )
    )


if __name__ == "__main__":
    main()
