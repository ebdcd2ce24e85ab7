#!/usr/bin/env bash
# vllm-fleet demo: boot real systemd hosts (nspawn sandbox), deploy the tiny CPU fleet to them with
# `ansible-playbook site.yml`, and finish with a real chat completion through the gateway.
#   make demo                                            one host (examples/tiny-cpu.yml)
#   make demo DEMO_SPEC=examples/tiny-cpu-2hosts.yml     two hosts: two primaries on h1, a backup on h2
# KEEP=1 leaves the hosts running; spec host hN becomes sandbox host ${DEMO_PREFIX:-demo-}hN.
# Needs root, systemd-nspawn and the repository's .venv (see docs/ansible.md).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${VENV:-$REPO/.venv}
export PATH="$VENV/bin:$PATH" ANSIBLE_CONFIG="$REPO/ansible.cfg"
SPEC=${DEMO_SPEC:-examples/tiny-cpu.yml}
PREFIX=${DEMO_PREFIX:-demo-}
read -r -a SPEC_HOSTS <<<"$(python -c "import sys, yaml; print(' '.join(h['name'] for h in yaml.safe_load(open(sys.argv[1]))['hosts']))" "$SPEC")"
HOSTS=()
for h in "${SPEC_HOSTS[@]}"; do HOSTS+=("$PREFIX$h"); done
WORK=$(mktemp -d /tmp/vllm-fleet-demo.XXXXXX)
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    echo "KEEP=1: ${HOSTS[*]} stay up (vllm-fleet sandbox ssh NAME; vllm-fleet sandbox down NAME); files in $WORK"
  else
    for h in "${HOSTS[@]}"; do vllm-fleet sandbox down "$h" >/dev/null 2>&1 || true; done
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
T0=$(date +%s)

step "1/5 tiny model (built offline) and the offline wheelhouse (from locks/cpu-0.32.0.txt)"
vllm-fleet tiny-model --out "$WORK/models/tiny" >/dev/null
# the spec's LoRA adapters (path sources, pushed from $WORK/models/NAME like the model): tiny random ones
ADAPTERS=$(python - "$SPEC" <<'PY'
import sys, yaml
for k, a in enumerate(yaml.safe_load(open(sys.argv[1])).get("adapters") or []):
    print((a["source"].get("path") or a["name"]).rstrip("/").rsplit("/", 1)[-1], a["rank"], k + 1)
PY
)
while read -r dir rank seed; do
  if [ -n "$dir" ]; then
    vllm-fleet tiny-adapter --base "$WORK/models/tiny" --out "$WORK/models/$dir" --rank "$rank" --seed "$seed" >/dev/null
  fi
done <<<"$ADAPTERS"
SANDBOX_WH=$(python -c 'from vllm_fleet.devtools.sandbox_image import ensure_wheelhouse; print(ensure_wheelhouse())')
CACHE=$(python -c 'from vllm_fleet.devtools.sandbox_image import cache_dir; print(cache_dir())')
WH="$CACHE/ansible-wheelhouse"
if [ ! -f "$WH/lock.txt" ] || [ "$WH/lock.txt" -ot locks/cpu-0.32.0.txt ]; then
  vllm-fleet lock wheelhouse --profile cpu --dest "$WH" --reuse "$SANDBOX_WH"
fi
echo "wheelhouse: $WH ($(ls "$WH"/*.whl | wc -l) wheels)"

step "2/5 boot ${HOSTS[*]} (systemd in nspawn, SSH, no route out; apt via a local proxy)"
for h in "${HOSTS[@]}"; do
  vllm-fleet sandbox up "$h" --engine --apt-proxy --bind-ro "$WH:/mnt/vf-wheelhouse"
done
vllm-fleet sandbox inventory --out "$WORK/inventory" >/dev/null
vllm-fleet sandbox list --json >"$WORK/hosts.json"
# the spec and the inventory, retargeted to these hosts (names and addresses)
GW_ADDR=$(python - "$SPEC" "$PREFIX" "$WORK" <<'PY'
import json, sys, yaml
from vllm_fleet.devtools.sandbox_net import retarget_spec
spec_path, prefix, work = sys.argv[1:]
spec = yaml.safe_load(open(spec_path))
addr = {h["name"]: h["address"] for h in json.load(open(f"{work}/hosts.json"))}
names = {h["name"]: prefix + h["name"] for h in spec["hosts"]}
spec = retarget_spec(spec, names, {n: addr[names[n]] for n in names}, purpose="demo")
yaml.safe_dump(spec, open(f"{work}/fleet.yml", "w"), sort_keys=False)
inv_path = f"{work}/inventory/hosts.yml"
inv = yaml.safe_load(open(inv_path))
inv["all"]["hosts"] = {n: inv["all"]["hosts"][n] for n in names.values()}
inv["all"].pop("children", None)
yaml.safe_dump(inv, open(inv_path, "w"))
gw = spec["gateway"]
# two or more gateways: clients use the virtual address; one: the gateway host's own
first = gw.get("host") or (gw.get("hosts") or [spec["hosts"][0]["name"]])[0]
first = first["name"] if isinstance(first, dict) else first
print(gw["virtual_address"].split("/")[0] if gw.get("virtual_address") else addr[first])
PY
)

step "3/5 ansible-playbook site.yml (preflight -> pinned venv -> model -> units -> gateway -> monitoring)"
T1=$(date +%s)
ansible-playbook -i "$WORK/inventory/hosts.yml" site.yml -e "vllm_fleet_spec=$WORK/fleet.yml" \
  -e "vllm_fleet_models_src=$WORK/models" -e "vllm_fleet_wheelhouse=$WH" \
  -e vllm_fleet_wheelhouse_remote=/mnt/vf-wheelhouse >"$WORK/ansible.log" 2>&1 &
APID=$!
tail -n +1 -f --pid=$APID "$WORK/ansible.log" | grep --line-buffered -E '^(PLAY|TASK|changed|fatal|failed)|PLAY RECAP|ok=' || true
if ! wait $APID; then
  echo "ansible-playbook failed; the whole log: $WORK/ansible.log (kept)" >&2
  tail -n 40 "$WORK/ansible.log" >&2
  KEEP=1
  exit 1
fi
T2=$(date +%s)

step "4/5 a real chat completion through the gateway (http://$GW_ADDR:8000)"
# the gateway requires an API key: the playbook generated one next to the inventory (docs/security.md)
KEY_FILE="$WORK/inventory/vllm-fleet-secrets/gateway-api-key"
python - "$GW_ADDR" "$KEY_FILE" <<'PY'
import json, sys, time, urllib.error, urllib.request
body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Say hello to the fleet."}], "max_tokens": 16}
key = open(sys.argv[2]).read().split()[0]
req = urllib.request.Request(f"http://{sys.argv[1]}:8000/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
# two or more gateways: the virtual address comes up once keepalived's checks have passed twice (a few s)
for attempt in range(30):
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
        break
    except urllib.error.URLError as exc:
        if attempt == 29 or isinstance(exc, urllib.error.HTTPError):
            raise
        time.sleep(2)
print(f"HTTP {r.status}  model={out['model']}  finish={out['choices'][0]['finish_reason']}  "
      f"tokens={out['usage']['completion_tokens']}")
print("reply (random tiny model, so gibberish):", repr(out["choices"][0]["message"]["content"]))
PY

step "5/5 what was deployed, and where"
for h in "${HOSTS[@]}"; do
  # a host without engines (a gateway or monitoring host only) has no deployment manifest
  vllm-fleet sandbox ssh "$h" "test -e /var/lib/vllm-fleet/manifest.json || { echo host $h: no engines; exit 0; }; \
python3 -c \"import json; m=json.load(open('/var/lib/vllm-fleet/manifest.json')); s=m['stack']; \
print('host', m['host'], '| fleet', m['fleet'], '| spec', m['spec_hash'], '|', s['vllm_dist'], s['vllm'], '| torch', s['torch']); \
[print('  ', i['unit'], 'port', i['port'], 'model', i['model']['path'], '(%d files, sha256-verified)' % len(i['model']['checksums'])) for i in m['instances']]\""
  vllm-fleet sandbox ssh "$h" "systemctl --no-legend list-units 'vllm@*' nginx.service keepalived.service prometheus.service prometheus-alertmanager.service 'prometheus-*exporter.service' vllm-fleet-exporter.service vllm-fleet-admission.service | sed 's/^/   /'"
done
echo "   gateway:    http://$GW_ADDR:8000/v1  (OpenAI + Anthropic APIs; API key in $KEY_FILE)"
# where Prometheus really listens (vllm_fleet/fleet/network.py: loopback on a one-host fleet, else the monitoring
# host's internal address), who may reach it (the firewall: the monitoring host and firewall.admin_sources) and
# how to log in (basic auth unless monitoring.web_auth is false)
python - "$WORK/fleet.yml" "$WORK/inventory" <<'PY'
import sys
from vllm_fleet.fleet.network import monitoring_address
from vllm_fleet.fleet.spec import load_spec
spec, inv = load_spec(sys.argv[1]), sys.argv[2]
mon, m, fw = spec.monitoring_host, spec.monitoring, spec.firewall
addr, port = monitoring_address(spec), m.prometheus_port
who = f"{mon} itself" + (f" and firewall.admin_sources ({', '.join(fw.admin_sources)})" if fw.admin_sources else "")
print(f"   prometheus: http://{addr}:{port}  reachable from {who if fw.enabled else 'the fleet'}")
if m.web_auth:
    print(f"               basic auth: user {m.web_user}, password in {inv}/vllm-fleet-secrets/monitoring-web-password")
    print(f"               (on {mon}: {m.web_password_file}; vllm-fleet status there reads it)")
print(f"               from here (KEEP=1): ssh -F {inv}/ssh_config -L {port}:{addr}:{port} {mon}, then http://127.0.0.1:{port}")
PY
echo "   manifest:   /var/lib/vllm-fleet/manifest.json on each host"
echo "playbook: $((T2 - T1)) s; demo total: $(( $(date +%s) - T0 )) s"
