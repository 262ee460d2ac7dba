"""The sidecar's ``--server-metrics`` scrape: each engine's documented exposition, served by a real
HTTP server on 127.0.0.1, read into the normalized state and exported as otel_gpu.inference.*."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.inference import SGLANG, TGI, TRITON, VLLM

from otel_gpu.inference.scrape import ServerScraper

pytestmark = pytest.mark.process


class Served:
    """A real HTTP server on 127.0.0.1 whose /metrics body the test sets."""

    def __init__(self) -> None:
        self.body = ""
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                data = served.body.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served() -> Iterator[Served]:
    server = Served()
    yield server
    server.close()


@pytest.mark.parametrize(
    ("text", "engine", "expected"),
    [
        (VLLM, "vllm", {"otel_gpu.inference.kv_cache.utilization": 0.42,
                        "otel_gpu.inference.requests.running": 7.0,
                        "otel_gpu.inference.requests.waiting": 3.0,
                        "otel_gpu.inference.preemptions": 5.0}),
        (SGLANG, "sglang", {"otel_gpu.inference.kv_cache.utilization": 0.87,
                            "otel_gpu.inference.requests.running": 12.0,
                            "otel_gpu.inference.requests.waiting": 0.0}),
        (TGI, "tgi", {"otel_gpu.inference.requests.running": 16.0,
                      "otel_gpu.inference.requests.waiting": 4.0}),
        (TRITON, "triton", {"otel_gpu.inference.requests.waiting": 5.0,
                            "otel_gpu.inference.queue.time": 2.0}),
    ],
)  # fmt: skip
def test_each_engine_is_read_by_its_own_names_into_the_normalized_metrics(
    served: Served, text: str, engine: str, expected: dict[str, float]
) -> None:
    served.body = text
    scraper = ServerScraper(served.url, interval_s=5.0)
    state = scraper.scrape_once()
    assert state is not None and state.engine == engine
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    scraper.register_instruments(provider.get_meter("test"))
    got: dict[str, tuple[float, dict]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    got[m.name] = (p.value, dict(p.attributes))
    provider.shutdown()
    assert {name: v for name, (v, _a) in got.items()} == pytest.approx(expected)
    assert {a["otel_gpu.inference.engine"] for _v, a in got.values()} == {engine}


def test_a_server_that_stops_answering_leaves_gaps_not_its_last_numbers(served: Served) -> None:
    now = [1000.0]
    served.body = VLLM
    scraper = ServerScraper(served.url, interval_s=1.0, clock=lambda: now[0])
    assert scraper.scrape_once() is not None and scraper.fresh() is not None
    served.body = "# TYPE http_requests_total counter\nhttp_requests_total 3\n"
    assert scraper.scrape_once() is None
    assert scraper.last_error is not None and "no vLLM, SGLang, TGI or Triton" in scraper.last_error
    now[0] += 3.5  # beyond three intervals without a good scrape
    assert scraper.fresh() is None


def test_an_unreachable_server_is_a_counted_failure_with_its_reason() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    scraper = ServerScraper(f"http://127.0.0.1:{port}/metrics", interval_s=1.0)
    assert scraper.scrape_once() is None
    assert scraper.failures == 1 and scraper.latest is None
    assert "refused" in (scraper.last_error or "").lower()
