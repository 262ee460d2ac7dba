"""The check to run on the first machine with a real NVIDIA GPU (a few minutes).

    python benchmarks/device_check.py [--seconds 30] [--json FILE]

1. NVML, real beside our fake: every NVML symbol the agent calls (found in otel_gpu/sampling/),
   whether each library exports it, what each call returned over a few sweeps of the agent's
   own NVML source (ok, NOT_SUPPORTED, ...), its median latency, and which metrics the source
   disabled per device. Each library is probed in its own child process.
2. ``nvidia-smi`` per sample: wall time of one query, for comparison with a sweep.
3. The agent beside a real CUDA training loop (torch): median step time without the agent and
   under ``otel-gpu run --interval 1 --exporter none``, and the wrapper + helper CPU.
4. The leak attribution's GPU allocation sites and the OOM post-mortem, wired as in a trainer
   (``memory.census`` with the allocator history switched on at a suspicion's census and off
   at the confirmation): the planted leak's site ranked first, the cost of one allocation with
   the history off, on and off again, and a real CUDA out-of-memory error caught by the
   observer (``oom-<pid>-1.json`` with its sites and holders, ``oom-<pid>-1.pickle`` loadable).

Without a GPU (no driver, NVML's init fails, or no device) it says so, checks what it can (the
fake's side of 1) and exits 0, so the script itself is tested on machines without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLK_TCK = os.sysconf("SC_CLK_TCK")
SWEEPS = 5


def called_symbols() -> list[str]:
    """Every NVML function the agent's sampling code names (pynvml's wrappers, or C symbols it
    looks up itself); pynvml's types and constants left out."""
    import inspect

    import pynvml

    names: set[str] = set()
    for path in (ROOT / "otel_gpu" / "sampling").glob("*.py"):
        names |= set(re.findall(r"\bnvml[A-Z]\w+", path.read_text()))
    return sorted(
        n
        for n in names
        if inspect.isfunction(getattr(pynvml, n, None))
        # a C symbol looked up by name; not a prefix the code completes (f"nvmlDeviceGet{x}")
        or (
            not hasattr(pynvml, n)
            and not n.endswith("_t")
            and not any(m != n and m.startswith(n) for m in names)
        )
    )


def real_library() -> str | None:
    for candidate in (
        ctypes.util.find_library("nvidia-ml"),
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib64/libnvidia-ml.so.1",
        "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    ):
        if candidate:
            try:
                lib = ctypes.CDLL(candidate)
            except OSError:
                continue
            return getattr(lib, "_name", candidate)
    return None


# -- 1. the probe (child process) -------------------------------------------------------------


def probe(library: str) -> dict[str, Any]:
    """Sweeps of the agent's NvmlSource on ``library``, every pynvml call timed."""
    import pynvml

    codes = {
        getattr(pynvml, n): n.removeprefix("NVML_ERROR_")
        for n in dir(pynvml)
        if n.startswith("NVML_ERROR_")
    }
    calls: dict[str, dict[str, Any]] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            entry = calls.setdefault(name, {"us": [], "results": {}})
            began = time.perf_counter()
            result = "ok"
            try:
                return fn(*args, **kwargs)
            except pynvml.NVMLError as err:
                result = codes.get(err.value, str(err.value))
                raise
            finally:
                entry["us"].append((time.perf_counter() - began) * 1e6)
                entry["results"][result] = entry["results"].get(result, 0) + 1

        return wrapper

    for name in dir(pynvml):  # before the agent's modules take references to them
        fn = getattr(pynvml, name)
        if name.startswith("nvml") and callable(fn):
            setattr(pynvml, name, timed(name, fn))
    lib = ctypes.CDLL(library)
    # pynvml's nvmlInit calls nvmlInit_v2 and so on: either C symbol counts.
    exported = {s: any(hasattr(lib, s + v) for v in ("", "_v2", "_v3")) for s in called_symbols()}
    from otel_gpu.sampling.nvml import NvmlSource

    source = NvmlSource(call_timeout_s=5.0, library_path=library, slow_period_s=0.0)
    sweeps = []
    reading = None
    for _ in range(SWEEPS):
        began = time.perf_counter()
        reading = source.sample()
        sweeps.append(time.perf_counter() - began)
        time.sleep(0.2)
    disabled = {d.uuid: sorted(d.disabled) for d in source._devices}
    host = source.host_info()
    source.close()
    return {
        "library": library,
        "gpus": len(reading.gpus) if reading is not None else 0,
        "no_gpu_reason": reading.no_gpu_reason if reading is not None else "no sweep",
        "driver": host.driver_version,
        "models": list(host.gpu_models),
        "sweep_ms": [round(s * 1000, 3) for s in sweeps],
        "exported": exported,
        "calls": {
            n: {
                "count": len(e["us"]),
                "median_us": round(statistics.median(e["us"]), 1),
                "results": e["results"],
            }
            for n, e in calls.items()
        },
        "disabled": disabled,
    }


def run_probe(library: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--probe", library],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if out.returncode != 0:
        return {"library": library, "error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def fake_library(work: Path) -> tuple[str, dict[str, str]] | None:
    try:
        from tests.fakenvml.build import build_fake
    except ImportError:
        return None
    try:
        lib = build_fake(work / "fake")
    except Exception as exc:  # no C compiler: the fake side is skipped, said so
        print(f"fake NVML not built ({exc}); comparing nothing against it")
        return None
    scenario = work / "fake-scenario.txt"
    scenario.write_text(
        "devices = 2\ngpu.0.processes = 4242:1073741824\ngpu.0.process_util = 4242:50:20\n"
    )
    env = dict(os.environ, FAKE_NVML_SCENARIO=str(scenario))
    return str(lib), env


def print_comparison(real: dict[str, Any] | None, fake: dict[str, Any] | None) -> None:
    def cell(side: dict[str, Any] | None, symbol: str) -> str:
        if side is None or "error" in side:
            return "-"
        exported = "yes" if side["exported"].get(symbol) else "NO"
        call = side["calls"].get(symbol)
        if call is None:
            return f"{exported:>3} {'not called':>28}"
        results = ",".join(f"{k}:{v}" for k, v in sorted(call["results"].items()))
        return f"{exported:>3} {results[:18]:>18} {call['median_us']:>8.1f}us"

    print(f"\n{'NVML symbol':44} | {'real: exported, results, median':33} | {'fake: same':33}")
    for symbol in called_symbols():
        print(f"{symbol:44} | {cell(real, symbol):33} | {cell(fake, symbol):33}")
    for name, side in (("real", real), ("fake", fake)):
        if side is not None and "error" not in side:
            print(
                f"{name}: {side['gpus']} GPU(s) {side['models']}, driver {side['driver']}, sweeps (ms) {side['sweep_ms']}"
            )
            for uuid, off in side["disabled"].items():
                if off:
                    print(f"  {uuid}: not supported, not asked again: {', '.join(off)}")
        elif side is not None:
            print(f"{name}: probe failed: {side['error']}")


# -- 2.-4. on a GPU ---------------------------------------------------------------------------


def time_nvidia_smi() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        subprocess.run(
            [exe, "--query-gpu=index,memory.used,utilization.gpu,power.draw,temperature.gpu", "--format=csv,noheader"],
            capture_output=True, timeout=60,
        )  # fmt: skip
        runs.append((time.perf_counter() - began) * 1000)
    return {"median_ms": round(statistics.median(runs), 1), "runs_ms": [round(r, 1) for r in runs]}


LOOP = """
import sys, time, torch
seconds = float(sys.argv[1])
x = torch.randn(4096, 4096, device="cuda")
w = torch.randn(4096, 4096, device="cuda", requires_grad=True)
opt = torch.optim.SGD([w], lr=1e-6)
steps, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    began = time.perf_counter()
    loss = (x @ w).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    torch.cuda.synchronize()
    steps.append(time.perf_counter() - began)
steps = steps[len(steps) // 10:]
print(sorted(steps)[len(steps) // 2] * 1000, len(steps), flush=True)
"""


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except OSError:
        return 0.0


def agent_beside_training(seconds: float) -> dict[str, Any]:
    bare = subprocess.run(
        [sys.executable, "-c", LOOP, str(seconds)],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    if bare.returncode != 0:
        return {"error": bare.stderr.strip().splitlines()[-1:]}
    bare_ms = float(bare.stdout.split()[0])
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    wrapped = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "run", "--quiet", "--interval", "1", "--exporter", "none",
         "--", sys.executable, "-c", LOOP, str(seconds)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    time.sleep(min(10.0, seconds / 3))
    helpers = [
        int(c)
        for t in os.listdir(f"/proc/{wrapped.pid}/task")
        for c in Path(f"/proc/{wrapped.pid}/task/{t}/children").read_text().split()
        if "sampling.worker" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")
    ]
    pids = [wrapped.pid, *helpers]
    c0, t0 = sum(cpu_seconds(p) for p in pids), time.monotonic()
    time.sleep(max(1.0, seconds / 2))
    cpu = (sum(cpu_seconds(p) for p in pids) - c0) / (time.monotonic() - t0)
    out, _ = wrapped.communicate(timeout=seconds + 120)
    with_ms = float(out.split()[0])
    return {"step_ms_bare": round(bare_ms, 3), "step_ms_with_agent": round(with_ms, 3),
            "slowdown": round(with_ms / bare_ms, 4), "agent_cpu_pct_of_core": round(100 * cpu, 3)}  # fmt: skip


MEMORY = """
import json, os, pickle, sys, tempfile, time
import torch
from otel_gpu.diagnose import cuda_memory as cm
from otel_gpu.diagnose.memory_settings import MemorySettings
from otel_gpu.tracing import memory_ops

d = tempfile.mkdtemp()
cm.watch_oom(d)  # before CUDA starts: attached at its initialisation
torch.zeros(1, device="cuda")
handle = memory_ops.census_handler(MemorySettings(census_max_s=2))
leak = []


def plant():
    leak.append(torch.empty(8 << 20, dtype=torch.uint8, device="cuda"))


def per_alloc_us(n=20000):
    t = time.perf_counter()
    for _ in range(n):
        torch.empty(1024, device="cuda")
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


off_before_us = per_alloc_us()
t = time.perf_counter()
baseline = handle({"over_s": 0, "top": 1, "sites": "suspect"})  # the history goes on
baseline_s = time.perf_counter() - t
on_us = per_alloc_us()
for _ in range(16):
    plant()
t = time.perf_counter()
confirm = handle({"over_s": 0, "baseline": "last", "top": 5, "sites": "confirm"})  # ranked, off
confirm_s = time.perf_counter() - t
off_us = per_alloc_us()
free, total = torch.cuda.mem_get_info()
try:
    torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")
    oom = "no error"
except torch.cuda.OutOfMemoryError as exc:
    oom = "OutOfMemoryError: " + str(exc).splitlines()[0][:100]
files = sorted(os.listdir(d))
post = {}
if f"oom-{os.getpid()}-1.json" in files:
    post = json.load(open(os.path.join(d, f"oom-{os.getpid()}-1.json")))
time.sleep(2)  # the viewer file is written by a thread of its own
viewer = os.path.join(d, f"oom-{os.getpid()}-1.pickle")
segments = len(pickle.load(open(viewer, "rb")).get("segments", [])) if os.path.exists(viewer) else None
print(json.dumps({
    "alloc_us_history_off": round(off_before_us, 3), "alloc_us_history_on": round(on_us, 3),
    "alloc_us_after_off": round(off_us, 3), "baseline_census_s": round(baseline_s, 3),
    "confirm_census_s": round(confirm_s, 3), "recording": baseline.get("sites_recording"),
    "top_site": (confirm.get("sites") or [{}])[0].get("site"),
    "site_lines": confirm.get("site_lines", [])[:2], "oom": oom, "oom_files": files,
    "oom_top_sites": post.get("sites", [])[:3], "viewer_segments": segments,
    "oom_top_holders": [(h["path"], h["bytes"]) for h in post.get("holders", [])[:3]],
}))
"""


def memory_paths() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", MEMORY], capture_output=True, text=True, timeout=300, env=env
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each training-loop run")
    ap.add_argument("--json", type=Path, help="also write every figure to this file")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return 0
    report: dict[str, Any] = {"symbols": called_symbols()}
    with tempfile.TemporaryDirectory() as tmp:
        fake_side = fake_library(Path(tmp))
        report["fake"] = run_probe(*fake_side) if fake_side else None
        lib = real_library()
        real = run_probe(lib, dict(os.environ)) if lib else None
    report["real"] = real
    gpu = real is not None and "error" not in real and real["gpus"] > 0
    print_comparison(real if gpu else None, report["fake"])
    if not gpu:
        why = (
            "no libnvidia-ml found"
            if lib is None
            else (real or {}).get("no_gpu_reason") or (real or {}).get("error")
        )
        print(
            f"\nno NVIDIA GPU here ({why}): checked the fake's side only; run this on a GPU machine"
        )
        report["gpu"] = False
    else:
        report["gpu"] = True
        report["nvidia_smi"] = time_nvidia_smi()
        print(f"\nnvidia-smi per sample: {report['nvidia_smi']}")
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if cuda:
            report["training"] = agent_beside_training(args.seconds)
            print(f"agent beside a CUDA training loop: {report['training']}")
            report["memory"] = memory_paths()
            print(f"torch memory history and OOM: {report['memory']}")
        else:
            print("torch with CUDA not available: training-loop and memory checks not run")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
