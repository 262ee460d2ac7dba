"""``otel-gpu sidecar`` beside ``otel-gpu run`` watching the same inference pod, CPU and memory
measured from outside.

    python benchmarks/bench_sidecar.py [--seconds 60] [--interval 5]

The pod: an inference-server stand-in (one API process and 8 worker processes, named
``vllm-bench``, serving a vLLM ``/metrics`` exposition over HTTP on 127.0.0.1) on the fake
libnvidia-ml with 2 GPUs, its workers listed as GPU processes. ``run`` launches one copy as its
job; the sidecar watches another copy (``--match vllm-bench``) and also scrapes its metrics
(``--server-metrics``) and serves ``/healthz`` and ``/readyz`` (probed every 5 s, as a kubelet
would). Both use the same interval, export OTLP gRPC every 10 s to a sink on 127.0.0.1 and run
detection; both are measured in the same windows (the shared VM's noise falls on both): the
command's process plus its sampling helper, never the server. CPU is utime + stime at the
window's ends; memory the RSS at the end. Ends with one JSON line (the sidecar's CPU, with
``run``'s as the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_vs_nvitop import CLK_TCK, children, cmdline, free_port  # noqa: E402
from bench_vs_nvitop import Window as _Window  # noqa: E402
from support.inference import VLLM  # noqa: E402
from support.otlp_sink import OtlpSink  # noqa: E402

from tests.fakenvml.build import build_fake  # noqa: E402

WARMUP_S = 10.0
PROBE_EVERY_S = 5.0
WORKERS = 8

# The server: renames itself (comm) so --match finds it, forks its workers, serves /metrics.
SERVER = f"""
import ctypes, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
ctypes.CDLL(None).prctl(15, b"vllm-bench", 0, 0, 0)  # PR_SET_NAME
kids = []
for _ in range({WORKERS}):
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    kids.append(pid)
body = sys.argv[2].encode()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
print(" ".join(map(str, kids)), flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def scenario(pids: list[int]) -> str:
    lines = ["devices = 2", "gpu.*.memory.total = 85899345920", "gpu.*.memory.used = 70000000000",
             "gpu.*.util.gpu = 85", "gpu.*.power.usage = 450000", "gpu.*.power.limit = 700000"]  # fmt: skip
    half = len(pids) // 2
    for gpu, group in enumerate((pids[:half], pids[half:])):
        lines.append(f"gpu.{gpu}.processes = " + " ".join(f"{p}:8000000000" for p in group))
    return "\n".join(lines) + "\n"


def measure(seconds: float, interval: float, lib: Path, work: Path, sink: OtlpSink) -> dict:
    scen = work / "scenario.txt"
    scen.write_text(scenario([]))
    env = dict(os.environ)
    env.update(
        LD_LIBRARY_PATH=f"{lib.parent}:{env.get('LD_LIBRARY_PATH', '')}",
        FAKE_NVML_SCENARIO=str(scen),
        OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
        OTEL_GPU_LOCK_DIR=str(work),
        PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}",
    )
    common = ["--interval", str(interval), "--export-interval", "10"]
    run_port, side_port, health = free_port(), free_port(), free_port()
    server = [sys.executable, "-c", SERVER]
    ours_run = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "run", *common, "--", *server, str(run_port), VLLM],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    pod = subprocess.Popen([*server, str(side_port), VLLM], stdout=subprocess.PIPE, text=True)
    assert ours_run.stdout is not None and pod.stdout is not None
    pids = [int(p) for p in ours_run.stdout.readline().split()]
    pids += [int(p) for p in pod.stdout.readline().split()]
    scen.write_text(scenario(pids))
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "otel_gpu.cli", "sidecar", *common, "--match", "vllm-bench",
         "--server-metrics", f"http://127.0.0.1:{side_port}/metrics",
         "--health", f"127.0.0.1:{health}"],
        env=env,
    )  # fmt: skip
    try:
        time.sleep(WARMUP_S)
        helpers = {
            name: [c for c in children(p.pid) if "otel_gpu.sampling.worker" in cmdline(c)]
            for name, p in (("run", ours_run), ("sidecar", sidecar))
        }
        assert all(helpers.values()), f"a sampling helper is missing: {helpers}"
        w_run = _Window([ours_run.pid, *helpers["run"]])
        w_side = _Window([sidecar.pid, *helpers["sidecar"]])
        probes = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(min(PROBE_EVERY_S, max(0.0, deadline - time.monotonic())))
            for path in ("/healthz", "/readyz"):
                with urllib.request.urlopen(f"http://127.0.0.1:{health}{path}", timeout=10) as r:
                    assert r.status == 200
            probes += 1
        run_cpu, run_rss = w_run.end()
        side_cpu, side_rss = w_side.end()
        waiting = [pt for pt in sink.points() if pt.metric == "otel_gpu.inference.requests.waiting"]
        assert waiting, "the sidecar exported no inference-server metrics"
        return {"seconds": seconds, "run_cpu": run_cpu, "run_rss": run_rss,
                "side_cpu": side_cpu, "side_rss": side_rss, "probes": probes}  # fmt: skip
    finally:
        for p in (sidecar, ours_run, pod):
            p.terminate()
        for p in (sidecar, ours_run, pod):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        for pid in pids[WORKERS:]:  # the sidecar's pod's workers (run's end with its job)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window length")
    ap.add_argument("--interval", type=float, default=5.0, help="sampling interval of both")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, OtlpSink() as sink:
        work = Path(tmp)
        r = measure(args.seconds, args.interval, build_fake(work / "lib"), work, sink)
    print(f"\n2 GPUs, 1 + {WORKERS} server processes, {args.interval:g} s sampling, "
          f"{r['seconds']:.0f} s window, both measured together (CLK_TCK {CLK_TCK})")  # fmt: skip
    print(f"{'':>22} | {'% core':>7} | {'RSS MiB':>8}")
    print(f"{'otel-gpu run':>22} | {100 * r['run_cpu']:>7.2f} | {r['run_rss'] / 2**20:>8.0f}")
    print(f"{'otel-gpu sidecar':>22} | {100 * r['side_cpu']:>7.2f} | {r['side_rss'] / 2**20:>8.0f}")
    ratio = r["side_cpu"] / r["run_cpu"] if r["run_cpu"] else float("inf")
    print(
        json.dumps(
            {
                "name": "sidecar_vs_run_cpu",
                "value": round(100 * r["side_cpu"], 3),
                "baseline": round(100 * r["run_cpu"], 3),
                "ratio": round(ratio, 3),
                "unit": "% of one core",
                "sidecar_rss_mib": round(r["side_rss"] / 2**20, 1),
                "run_rss_mib": round(r["run_rss"] / 2**20, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
