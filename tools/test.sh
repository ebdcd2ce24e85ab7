#!/usr/bin/env bash
# `make test`: the suite in two halves at once. The tests that boot sandbox hosts (marker `sandbox`: nspawn
# hosts, engines loading inside them, systemd timers) and the rest (unit tests, local engines, nginx,
# Prometheus) wait on different things, so on two cores they overlap: the wall time is about the longer half
# instead of the sum. Each half is one pytest session (its session- and module-scoped engines start once);
# its lines are prefixed with its name. Arguments go to both halves; a half that selects nothing is fine.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONUNBUFFERED=1
half() {  # NAME MARKEXPR ARGS...
  local name=$1 expr=$2
  shift 2
  # own temp and cache dirs: the two sessions never clean up or rewrite each other's
  "$PY" -m pytest -m "$expr" --basetemp="/tmp/vllm-fleet-test-$name" -o cache_dir=".pytest_cache/$name" "$@" 2>&1 |
    sed -u "s/^/[$name] /"
  return "${PIPESTATUS[0]}"
}
trap 'kill 0' INT TERM  # a stop of `make test` stops both halves (their fixtures tear down on SIGTERM)
half hosts "sandbox" "$@" &
hosts_pid=$!
half local "not sandbox" "$@" &
local_pid=$!
rc=0
for pid in $hosts_pid $local_pid; do
  wait "$pid"
  r=$?
  # 5: that half selected no test (e.g. `make test PYTEST_ARGS=tests/unit`)
  if [ "$r" != 0 ] && [ "$r" != 5 ]; then rc=1; fi
done
echo "make test: hosts half and local half done, exit $rc"
exit $rc
