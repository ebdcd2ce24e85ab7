#!/usr/bin/env bash
# vllm-fleet demo: boot a real systemd host (nspawn sandbox), deploy the tiny CPU fleet to it with
# `ansible-playbook site.yml`, and finish with a real chat completion through the gateway.
#   make demo            (KEEP=1 leaves the host running; DEMO_HOST=name picks its name)
# Needs root, systemd-nspawn and the repository's .venv (see docs/ansible.md).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${VENV:-$REPO/.venv}
export PATH="$VENV/bin:$PATH" ANSIBLE_CONFIG="$REPO/ansible.cfg"
HOST=${DEMO_HOST:-demo-h1}
WORK=$(mktemp -d /tmp/vllm-fleet-demo.XXXXXX)
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    echo "KEEP=1: $HOST stays up (vllm-fleet sandbox ssh $HOST; vllm-fleet sandbox down $HOST); files in $WORK"
  else
    vllm-fleet sandbox down "$HOST" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
T0=$(date +%s)

step "1/5 tiny model (built offline) and the offline wheelhouse (from locks/cpu-0.32.0.txt)"
vllm-fleet tiny-model --out "$WORK/models/tiny" >/dev/null
SANDBOX_WH=$(python -c 'from vllm_fleet.sandbox_image import ensure_wheelhouse; print(ensure_wheelhouse())')
CACHE=$(python -c 'from vllm_fleet.sandbox_image import cache_dir; print(cache_dir())')
WH="$CACHE/ansible-wheelhouse"
if [ ! -f "$WH/lock.txt" ] || [ "$WH/lock.txt" -ot locks/cpu-0.32.0.txt ]; then
  vllm-fleet lock wheelhouse --profile cpu --dest "$WH" --reuse "$SANDBOX_WH"
fi
echo "wheelhouse: $WH ($(ls "$WH"/*.whl | wc -l) wheels)"

step "2/5 boot the sandbox host $HOST (systemd in nspawn, SSH, no route out; apt via a local proxy)"
vllm-fleet sandbox up "$HOST" --engine --apt-proxy --bind-ro "$WH:/mnt/vf-wheelhouse"
vllm-fleet sandbox inventory --out "$WORK/inventory" >/dev/null
ADDR=$(vllm-fleet sandbox list --json | python -c "import json,sys; print(next(h['address'] for h in json.load(sys.stdin) if h['name']=='$HOST'))")
python - "$HOST" "$ADDR" "$WORK/fleet.yml" <<'PY'
import sys, yaml
name, addr, out = sys.argv[1:]
spec = yaml.safe_load(open("examples/tiny-cpu.yml"))
spec["hosts"][0].update(name=name, address=addr)
for m in spec["models"]:
    m["host"] = name
spec["gateway"]["host"] = spec["monitoring"]["host"] = name
yaml.safe_dump(spec, open(out, "w"), sort_keys=False)
PY
# only this host in the inventory
python - "$WORK/inventory/hosts.yml" "$HOST" <<'PY'
import sys, yaml
path, name = sys.argv[1:]
inv = yaml.safe_load(open(path))
inv["all"]["hosts"] = {name: inv["all"]["hosts"][name]}
inv["all"].pop("children", None)
yaml.safe_dump(inv, open(path, "w"))
PY

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
ssh_run() { vllm-fleet sandbox ssh "$HOST" "$@"; }

step "4/5 a real chat completion through the gateway (http://$ADDR:8000)"
python - "$ADDR" <<'PY'
import json, sys, urllib.request
body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Say hello to the fleet."}], "max_tokens": 16}
req = urllib.request.Request(f"http://{sys.argv[1]}:8000/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    out = json.load(r)
print(f"HTTP {r.status}  model={out['model']}  finish={out['choices'][0]['finish_reason']}  "
      f"tokens={out['usage']['completion_tokens']}")
print("reply (random tiny model, so gibberish):", repr(out["choices"][0]["message"]["content"]))
PY

step "5/5 what was deployed, and where"
ssh_run "python3 -c \"import json; m=json.load(open('/var/lib/vllm-fleet/manifest.json')); s=m['stack']; \
print('host', m['host'], '| fleet', m['fleet'], '| spec', m['spec_hash'], '|', s['vllm_dist'], s['vllm'], '| torch', s['torch']); \
[print('  ', i['unit'], 'port', i['port'], 'model', i['model']['path'], '(%d files, sha256-verified)' % len(i['model']['checksums'])) for i in m['instances']]\""
ssh_run "systemctl --no-legend list-units 'vllm@*' nginx.service prometheus.service prometheus-alertmanager.service 'prometheus-*exporter.service' vllm-fleet-exporter.service | sed 's/^/   /'"
echo "   gateway:    http://$ADDR:8000/v1  (OpenAI + Anthropic APIs)"
echo "   prometheus: http://$ADDR:9090 (on the host)   manifest: /var/lib/vllm-fleet/manifest.json"
echo "playbook: $((T2 - T1)) s; demo total: $(( $(date +%s) - T0 )) s"
