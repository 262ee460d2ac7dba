"""An inference server's metrics, normalized across vLLM, SGLang, TGI and Triton: the sidecar's
``--server-metrics`` scrape (``otel_gpu/inference/scrape.py``)."""

from otel_gpu.core.signals.model import COUNTER, GAUGE, Signal

INFERENCE_ENGINE = "otel_gpu.inference.engine"  # attribute: vllm, sglang, tgi, triton

INFERENCE_KV_CACHE_UTILIZATION = Signal(
    "otel_gpu.inference.kv_cache.utilization",
    GAUGE,
    "1",
    "Fraction of the inference server's KV cache in use",
)
INFERENCE_REQUESTS_RUNNING = Signal(
    "otel_gpu.inference.requests.running",
    GAUGE,
    "{request}",
    "Requests the inference server is running",
)
INFERENCE_REQUESTS_WAITING = Signal(
    "otel_gpu.inference.requests.waiting",
    GAUGE,
    "{request}",
    "Requests queued in the inference server, waiting to run",
)
INFERENCE_PREEMPTIONS = Signal(
    "otel_gpu.inference.preemptions",
    COUNTER,
    "{preemption}",
    "Requests the inference server preempted (KV cache exhausted)",
)
INFERENCE_QUEUE_TIME = Signal(
    "otel_gpu.inference.queue.time",
    COUNTER,
    "s",
    "Cumulative time requests spent queued in the inference server",
)
