"""The points that ``--exporter console`` printed (the SDK's ConsoleMetricExporter JSON documents)."""

from __future__ import annotations

import json


def console_points_by_name(stdout: str) -> dict[str, list[dict]]:
    """Data points by metric name from ConsoleMetricExporter's JSON documents."""
    found: dict[str, list[dict]] = {}
    decoder = json.JSONDecoder()
    text, i = stdout, 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return found
        try:
            doc, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        i = end
        for rm in doc.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for m in sm["metrics"]:
                    found.setdefault(m["name"], []).extend(m["data"]["data_points"])


def console_points(out: str) -> list[tuple[str, dict, float, int]]:
    """(name, attributes, value, export number) of every point the console exporter printed."""
    decoder = json.JSONDecoder()
    points = []
    i, n = 0, 0
    while True:
        start = out.find("{", i)
        if start < 0:
            return points
        doc, i = decoder.raw_decode(out, start)
        n += 1
        for rm in doc.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for m in sm["metrics"]:
                    for p in m["data"]["data_points"]:
                        points.append((m["name"], p["attributes"], p["value"], n))
