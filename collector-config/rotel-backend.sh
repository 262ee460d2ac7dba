#!/bin/sh
# The backend side of collector-config/rotel.sh: rotel receiving what `otel-gpu processor`
# forwards (everything, plus alert log records and detector metrics) and exporting it over OTLP
# to the backend at BACKEND (Jaeger, Tempo, SigNoz, an OpenTelemetry Collector, ...).
#
#   otel-gpu processor --forward 127.0.0.1:4319 --> rotel :4319 --> $BACKEND
#
# Ports: ROTEL_GRPC (127.0.0.1:4319), ROTEL_HTTP (127.0.0.1:4320; not 4318, which the front
# rotel or a collector holds); BACKEND (http://127.0.0.1:4327), BACKEND_PROTOCOL (grpc|http).
# exec: rotel itself gets SIGTERM and flushes its batches before exiting.
set -eu
ROTEL_AGENT=$(python3 -c 'import pathlib, rotel; print(pathlib.Path(rotel.__file__).parent / "rotel-agent")')
exec "$ROTEL_AGENT" start \
    --otlp-grpc-endpoint "${ROTEL_GRPC:-127.0.0.1:4319}" \
    --otlp-http-endpoint "${ROTEL_HTTP:-127.0.0.1:4320}" \
    --exporter otlp \
    --otlp-exporter-endpoint "${BACKEND:-http://127.0.0.1:4327}" \
    --otlp-exporter-protocol "${BACKEND_PROTOCOL:-grpc}" \
    --batch-timeout 200ms
