#!/bin/sh
# rotel (pip install rotel; a Rust OTLP collector) in front of `otel-gpu processor`:
#   agents --OTLP gRPC--> rotel :4317 --> otel-gpu processor :14317 --> $DOWNSTREAM
# The processor forwards everything, plus its alerts and detector metrics, to DOWNSTREAM.
set -eu
PROCESSOR=${PROCESSOR:-127.0.0.1:14317}
DOWNSTREAM=${DOWNSTREAM:-127.0.0.1:4319}

otel-gpu processor --listen "$PROCESSOR" --forward "$DOWNSTREAM" \
    --state "${STATE:-./otel-gpu-processor.db}" --health 127.0.0.1:13134 &
PROCESSOR_PID=$!
trap 'kill -TERM "$PROCESSOR_PID" 2>/dev/null; wait "$PROCESSOR_PID"' EXIT INT TERM

ROTEL_AGENT=$(python -c 'import pathlib, rotel; print(pathlib.Path(rotel.__file__).parent / "rotel-agent")')
"$ROTEL_AGENT" start \
    --otlp-grpc-endpoint 127.0.0.1:4317 \
    --otlp-http-endpoint 127.0.0.1:4318 \
    --exporter otlp \
    --otlp-exporter-endpoint "http://$PROCESSOR" \
    --otlp-exporter-protocol grpc \
    --batch-timeout 200ms
