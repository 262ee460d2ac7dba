#!/usr/bin/env bash
# The real peers the test suite runs that are not the project's own dependencies. From Debian:
# Prometheus 2.42 with promtool, Alertmanager with amtool, docker-compose (config validation
# only; no engine), and Chromium (headless page tests). From PyPI, in its own virtualenv (about
# 850 MB, kept out of the project's environment): arize-phoenix, a real OTLP trace store
# (tests/support/phoenix_peer.py finds it there). Installs only what is missing; does nothing
# when all are there.
set -euo pipefail
PEERS_DIR=${OTEL_GPU_PEERS_DIR:-$HOME/.cache/otel-gpu-peers}
PHOENIX_VERSION=20.26.1  # tests/support/phoenix_peer.py checks this version
phoenix="$PEERS_DIR/phoenix"
if ! "$phoenix/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('arize-phoenix') != '$PHOENIX_VERSION')" 2>/dev/null; then
  echo "tests/install-peers.sh: installing arize-phoenix $PHOENIX_VERSION in $phoenix (PyPI)" >&2
  rm -rf "$phoenix"
  python3 -m venv "$phoenix"
  "$phoenix/bin/pip" install -q --disable-pip-version-check "arize-phoenix==$PHOENIX_VERSION"
fi
declare -A need=(
  [prometheus]=prometheus
  [promtool]=prometheus
  [amtool]=prometheus-alertmanager
  [docker-compose]=docker-compose
  [chromium]=chromium
)
missing=()
for bin in "${!need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${need[$bin]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "tests/install-peers.sh: installing ${pkgs[*]} (Debian)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
