"""Cost of one live-tensor census (otel_gpu/diagnose/census.py) against 10k / 100k / 1M live
objects, beside the baseline measured in the same run: ``gc.get_objects()`` and a filter for
tensors alone, the least any gc-based census pays.

    python benchmarks/bench_census.py [--sizes 10000,100000,1000000]

Each size is a module of "the program" holding that many objects reachable from its globals
(groups of a dict, a list and 97 one-item lists; one object in 100 a tensor), so the walk visits them all. The census
runs on another thread, as the channel runs it, while this thread waits. Prints seconds per
size and ends with one JSON line {"name", "value", "baseline", "ratio", "unit"} for the largest.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from otel_gpu.diagnose import census  # noqa: E402


def planted(n: int, where: Path) -> types.ModuleType:
    mod = types.ModuleType("benchtrain")
    mod.__file__ = str(where / "benchtrain.py")
    groups = []
    for _ in range(n // 100):
        groups.append({"step": [[j] for j in range(97)], "t": torch.zeros(1)})
    mod.history = groups
    sys.modules["benchtrain"] = mod
    return mod


def on_thread(fn):  # type: ignore[no-untyped-def]
    out = {}
    t = threading.Thread(target=lambda: out.update(v=fn()))
    t.start()
    t.join()
    return out["v"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    args = parser.parse_args()
    bounds = census.Bounds(max_objects=10_000_000, max_s=600.0)
    last = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'objects':>9} {'visited':>9} {'tensors':>8} {'census s':>9} {'gc-only s':>9}")
        for n in (int(s) for s in args.sizes.split(",")):
            planted(n, Path(tmp))
            gc.collect()
            started = time.perf_counter()
            on_thread(lambda: [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)])
            base = time.perf_counter() - started
            c = on_thread(lambda: census.take(bounds))
            print(f"{n:>9} {c.visited:>9} {c.tensors:>8} {c.took_s:>9.3f} {base:>9.3f}")
            last = {"n": n, "census": c.took_s, "base": base}
            del sys.modules["benchtrain"]
    print(
        json.dumps(
            {
                "name": f"census_s_{last['n']}_objects",
                "value": round(last["census"], 4),
                "baseline": round(last["base"], 4),
                "ratio": round(last["census"] / last["base"], 2) if last["base"] else None,
                "unit": "s",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
