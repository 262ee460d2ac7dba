"""Inference servers' own Prometheus metrics, read into one small normalized state (pure).

Each engine is recognised by the metric names it documents; the first engine whose names appear
in a scrape wins. Samples of one metric are summed over their labels (a server with two models
or two engine replicas reports each), except the KV-cache fraction, of which the highest is
kept (the fullest cache is the one that will preempt first).

| engine | KV cache (0..1)          | running                   | waiting                              | preemptions           |
|--------|--------------------------|---------------------------|--------------------------------------|-----------------------|
| vLLM   | vllm:kv_cache_usage_perc | vllm:num_requests_running | vllm:num_requests_waiting            | vllm:num_preemptions  |
| SGLang | sglang:token_usage       | sglang:num_running_reqs   | sglang:num_queue_reqs                |                       |
| TGI    |                          | tgi_batch_current_size    | tgi_queue_size                       |                       |
| Triton |                          |                           | nv_inference_pending_request_count   |                       |

vLLM's ``*_perc`` gauges are fractions 0..1 despite the name; older vLLM releases call the KV
gauge ``vllm:gpu_cache_usage_perc``. Triton's ``nv_inference_queue_duration_us`` (cumulative
microseconds spent queued) is kept as ``queue_seconds``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineNames:
    """The metric names one engine documents for each normalized field (None: not exported)."""

    engine: str
    kv_cache: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()  # a counter: its samples carry a _total suffix
    queue_us: tuple[str, ...] = ()  # a counter of microseconds

    def names(self) -> set[str]:
        return {
            *self.kv_cache,
            *self.running,
            *self.waiting,
            *self.preemptions,
            *self.queue_us,
        }


ENGINES = (
    EngineNames(
        "vllm",
        kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        preemptions=("vllm:num_preemptions",),
    ),
    EngineNames(
        "sglang",
        kv_cache=("sglang:token_usage",),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
    ),
    EngineNames("tgi", running=("tgi_batch_current_size",), waiting=("tgi_queue_size",)),
    EngineNames(
        "triton",
        waiting=("nv_inference_pending_request_count",),
        queue_us=("nv_inference_queue_duration_us",),
    ),
)


@dataclass(frozen=True, slots=True)
class ServerState:
    """One scrape of an inference server, normalized. ``None``: the engine does not say."""

    time: float  # s since epoch when the scrape finished
    engine: str
    kv_cache_utilization: float | None = None  # 0..1
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions: float | None = None  # cumulative count
    queue_seconds: float | None = None  # cumulative time requests spent queued


def parse_exposition(text: str, time: float) -> ServerState | None:
    """The normalized state of one Prometheus text exposition; None when no known engine's
    metrics are in it. Raises ValueError on text that is not the exposition format."""
    # Imported here: only a serving replica's scrape needs the parser, not every agent.
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    highest: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("histogram", "gaugehistogram", "summary"):
            continue  # no normalized field is a distribution
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_created"):
                continue
            # A counter's samples carry _total; its documented name does not.
            name = sample.name.removesuffix("_total")
            value = float(sample.value)
            if not math.isfinite(value):
                continue
            totals[name] = totals.get(name, 0.0) + value
            highest[name] = max(highest.get(name, -math.inf), value)
    for names in ENGINES:
        if names.names() & totals.keys():
            return ServerState(
                time=time,
                engine=names.engine,
                kv_cache_utilization=_first(names.kv_cache, highest),
                requests_running=_first(names.running, totals),
                requests_waiting=_first(names.waiting, totals),
                preemptions=_first(names.preemptions, totals),
                queue_seconds=_scaled(_first(names.queue_us, totals), 1e-6),
            )
    return None


def _first(candidates: Iterable[str], values: dict[str, float]) -> float | None:
    for name in candidates:
        if name in values:
            return values[name]
    return None


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
