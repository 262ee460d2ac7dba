#!/usr/bin/env bash
# The real peers the test suite runs that come from Debian, not PyPI: Prometheus 2.42 with
# promtool, Alertmanager with amtool, docker-compose (config validation only; no engine), and
# Chromium (headless page tests). Installs only what is missing; does nothing when all are there.
set -euo pipefail
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
