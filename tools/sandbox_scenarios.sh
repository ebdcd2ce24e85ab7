#!/usr/bin/env bash
# The bench's failover and rolling-restart scenarios against the two-host sandbox fleet that
#   make demo DEMO_SPEC=examples/tiny-cpu-2hosts.yml KEEP=1
# leaves running (demo-h1: gateway + tiny-a + tiny-b, demo-h2: tiny-backup). Everything goes through the real
# units and the real gateway: kill -9 is `systemctl kill --signal=SIGKILL` of the whole unit, the rolling
# restart is `vllm-fleet drain` on the gateway host → `systemctl restart` (returns when READY) → `undrain`.
#   tools/sandbox_scenarios.sh [failover|rolling-restart|both] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
WHAT=${1:-both}
OUT=${2:-/tmp/vllm-fleet-scenarios}
P=${DEMO_PREFIX:-demo-}
H1=${P}h1
GW=$(vllm-fleet sandbox list --json | python -c "import json,sys; print(next(h['address'] for h in json.load(sys.stdin) if h['name']=='$H1'))")
URL="http://$GW:8000"
REMOTE=/opt/vllm-fleet/venv/bin/vllm-fleet
# --no-tokenize: sizing prompts exactly probes /tokenize ~150 times at once, which the gateway's per-IP rate limit
# (burst 100) answers with 429 - approximate prompt sizes are fine for a failure count
COMMON=(--profile tiny-failover --concurrency ${CONCURRENCY:-4} --no-tokenize --no-metrics --out "$OUT")
health() {  # a command that exits 0 when the instance on host $1, port $2 answers /health
  echo "vllm-fleet sandbox ssh $1 -- python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:$2/health\", timeout=3)'"
}

if [ "$WHAT" = failover ] || [ "$WHAT" = both ]; then
  vllm-fleet bench "$URL" "${COMMON[@]}" --duration 900 --name sandbox-failover \
    --scenario failover --at 20 \
    --during "vllm-fleet sandbox ssh $H1 systemctl kill --signal=SIGKILL vllm@tiny-a.service" \
    --health-cmd "$(health "$H1" 8101)" --after-recovery 15
fi
if [ "$WHAT" = rolling-restart ] || [ "$WHAT" = both ]; then
  vllm-fleet bench "$URL" "${COMMON[@]}" --duration 1800 --name sandbox-rolling-restart \
    --scenario rolling-restart --start-after 15 --settle 10 --cmd-timeout 900 \
    --instances "tiny-a@$H1,tiny-b@$H1,tiny-backup@${P}h2" \
    --drain-cmd "vllm-fleet sandbox ssh $H1 $REMOTE drain {name} --wait 60" \
    --restart-cmd "vllm-fleet sandbox ssh {host} systemctl restart vllm@{name}.service" \
    --ready-cmd "vllm-fleet sandbox ssh {host} systemctl is-active --quiet vllm@{name}.service" \
    --undrain-cmd "vllm-fleet sandbox ssh $H1 $REMOTE undrain {name}"
fi
