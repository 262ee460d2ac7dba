#!/bin/sh
# rotel (pip install rotel; an OTLP collector written in Rust) in front of `otel-gpu processor`,
# the collector-less way to run the processor on one machine:
#
#   agents --OTLP gRPC--> rotel :4317 --> otel-gpu processor :14317 --> $DOWNSTREAM
#                                                                  (rotel-backend.sh :4319)
#
# The processor forwards everything it receives, plus its alerts and detector metrics, to
# DOWNSTREAM; start collector-config/rotel-backend.sh there to fan out to your backends.
# SIGTERM or SIGINT stops rotel first (it flushes into the processor), then the processor (it
# flushes downstream within its --flush-timeout).
#
# Every port can be moved: ROTEL_GRPC / ROTEL_HTTP (4317 / 4318, where agents send by
# default), PROCESSOR (127.0.0.1:14317), HEALTH (127.0.0.1:13134, /healthz), DOWNSTREAM
# (127.0.0.1:4319). The OpenTelemetry Collector config in this folder uses 4317-4319 as well:
# run one or the other on a host, or move these. The processor takes its other settings from
# its OTEL_GPU_PROCESSOR_* variables, e.g. OTEL_GPU_PROCESSOR_PROMETHEUS=127.0.0.1:9465 for a
# Prometheus /metrics of its detector metrics.
set -eu
ROTEL_GRPC=${ROTEL_GRPC:-127.0.0.1:4317}
ROTEL_HTTP=${ROTEL_HTTP:-127.0.0.1:4318}
PROCESSOR=${PROCESSOR:-127.0.0.1:14317}
HEALTH=${HEALTH:-127.0.0.1:13134}
DOWNSTREAM=${DOWNSTREAM:-127.0.0.1:4319}
STATE=${STATE:-./otel-gpu-processor.db}
ROTEL_AGENT=$(python3 -c 'import pathlib, rotel; print(pathlib.Path(rotel.__file__).parent / "rotel-agent")')

otel-gpu processor --listen "$PROCESSOR" --forward "$DOWNSTREAM" --state "$STATE" \
    --health "$HEALTH" &
PROCESSOR_PID=$!
"$ROTEL_AGENT" start \
    --otlp-grpc-endpoint "$ROTEL_GRPC" \
    --otlp-http-endpoint "$ROTEL_HTTP" \
    --exporter otlp \
    --otlp-exporter-endpoint "http://$PROCESSOR" \
    --otlp-exporter-protocol grpc \
    --batch-timeout 200ms &
ROTEL_PID=$!

stop() {
    trap - INT TERM
    kill -TERM "$ROTEL_PID" 2>/dev/null || true
    wait "$ROTEL_PID" 2>/dev/null || true
    kill -TERM "$PROCESSOR_PID" 2>/dev/null || true
    wait "$PROCESSOR_PID" 2>/dev/null || true
}
trap 'stop; exit 143' TERM
trap 'stop; exit 130' INT

# Either child ending ends both (the script's exit status is then the first one's).
while kill -0 "$ROTEL_PID" 2>/dev/null && kill -0 "$PROCESSOR_PID" 2>/dev/null; do
    sleep 1 &
    wait $! || true
done
stop
exit 1
