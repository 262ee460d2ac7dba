"""Re-pin ``v1.44.0.yaml`` from a checkout of open-telemetry/semantic-conventions:

    python tests/data/semconv/excerpt.py PATH/TO/semantic-conventions v1.44.0 > tests/data/semconv/v1.44.0.yaml

Reads the tag's ``model/`` files with ``git show`` and keeps, for the groups otel-gpu uses
(hw, process, cpu, vcs, k8s), each attribute's type (and an enum's values) and each metric's
instrument, unit and attributes with their requirement levels (``ref_group`` expanded, the
GPU refinements of ``hw.errors`` and ``hw.status`` applied). Not run by the suite.
"""

from __future__ import annotations

import subprocess
import sys

import yaml

FILES = {
    "attributes": [
        "model/hardware/registry.yaml",
        "model/process/registry.yaml",
        "model/cpu/registry.yaml",
        "model/vcs/registry.yaml",
        "model/k8s/registry.yaml",
    ],
    "metrics": [
        "model/hardware/common.yaml",
        "model/hardware/common-metrics.yaml",
        "model/hardware/gpu-metrics.yaml",
        "model/hardware/temperature-metrics.yaml",
        "model/process/metrics.yaml",
    ],
}
GPU_REFINEMENTS = {"metric.hw.gpu.errors", "metric.hw.gpu.status"}


def _level(item: dict) -> str:
    level = item.get("requirement_level", "recommended")
    return level if isinstance(level, str) else next(iter(level))


def main(repo: str, tag: str) -> None:
    def load(path: str) -> dict:
        text = subprocess.run(
            ["git", "-C", repo, "show", f"{tag}:{path}"], capture_output=True, text=True, check=True
        ).stdout
        return yaml.safe_load(text) or {}

    commit = subprocess.run(
        ["git", "-C", repo, "rev-parse", f"{tag}^{{commit}}"], capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    attributes: dict[str, dict] = {}
    for path in FILES["attributes"]:
        for group in load(path).get("groups", []):
            for a in group.get("attributes", []):
                kind = a["type"]
                entry: dict = {"type": "enum" if isinstance(kind, dict) else kind}
                if isinstance(kind, dict):
                    entry["values"] = sorted(str(m["value"]) for m in kind["members"])
                attributes[a["id"]] = entry
    docs = [load(p) for p in FILES["metrics"]]
    groups: dict[str, list[tuple[str, str]]] = {}
    for doc in docs:
        for g in doc.get("attribute_groups", []):
            groups[g["id"]] = [(a["ref"], _level(a)) for a in g["attributes"] if "ref" in a] + [
                ("@" + a["ref_group"], "") for a in g["attributes"] if "ref_group" in a
            ]

    def expand(items: list[dict]) -> dict[str, str]:
        out: dict[str, str] = {}
        for a in items:
            if "ref_group" in a:
                for ref, level in groups[a["ref_group"]]:
                    if ref.startswith("@"):
                        out.update(expand([{"ref_group": ref[1:]}]))
                    else:
                        out[ref] = level
            else:
                out[a["ref"]] = _level(a)
        return out

    metrics: dict[str, dict] = {}
    for doc in docs:
        for m in doc.get("metrics", []):
            metrics[m["name"]] = {
                "instrument": m["instrument"],
                "unit": str(m["unit"]),
                "attributes": expand(m.get("attributes", [])),
            }
        for g in doc.get("groups", []):
            if g.get("type") == "metric":
                metrics[g["metric_name"]] = {
                    "instrument": g["instrument"],
                    "unit": str(g["unit"]),
                    "attributes": expand(g.get("attributes", [])),
                }
    for doc in docs:
        for r in doc.get("metric_refinements", []):
            if r["id"] in GPU_REFINEMENTS:  # a level left out keeps the metric's own
                base = metrics[r["ref"]]["attributes"]
                for a in r.get("attributes", []):
                    refined = expand([a])
                    if "ref" in a and "requirement_level" not in a and a["ref"] in base:
                        continue
                    base.update(refined)
    print(f"# An excerpt of the OpenTelemetry semantic conventions {tag}, made by excerpt.py.")
    print("# Source: https://github.com/open-telemetry/semantic-conventions")
    print(f"#   tag {tag}, commit {commit}")
    for kind, paths in FILES.items():
        print(f"#   {kind} from: {', '.join(paths)}")
    print("# Apache License 2.0, Copyright The OpenTelemetry Authors.")
    out = {"version": tag.lstrip("v"), "attributes": attributes, "metrics": metrics}
    sys.stdout.write(yaml.safe_dump(out, sort_keys=True, width=100))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
