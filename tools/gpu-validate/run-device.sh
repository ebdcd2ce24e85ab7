#!/bin/bash
# Device side of the GPU validation (docs/gpu-validation.md). Run from the repo root on the H200 machine.
#   run-device.sh stash DIR     copy one carried bundle part (DIR/bundle.part-*) to /root/parts
#   run-device.sh install       reassemble the bundle, install vLLM + deps into /tmp/site, nginx, model
#   run-device.sh start-bare    start a bare `vllm serve` (own session: it outlives the call), wait healthy
#   run-device.sh measure OUT   launcher + gateway + bench + logs (tools/gpu-validate/measure.py)
#   run-device.sh churn OUT     liveness under connection churn: 2,000 lanes, a new connection per request,
#                               through the gateway then at the engine (tools/gpu-validate/churn.py)
#   run-device.sh classes OUT   request classes on the real engine: interactive TTFT while batch saturates it,
#                               gateway with and without classes (tools/gpu-validate/classes.py)
#   run-device.sh lora-fleet OUT  LoRA adapters through vllm-fleet: fetch, launcher, gateway, burst, adapters sync
#                               under traffic, exporter, stop (tools/gpu-validate/lora_fleet.py)
#   run-device.sh sleep-fleet OUT  sleep mode through vllm-fleet: two models of one swap group taking turns on the
#                               GPU under alternating traffic, launchers + guard + gateway (tools/gpu-validate/sleep_fleet.py)
#   run-device.sh sleep-scale OUT  sleep mode at scale: 4 models in one swap group (2 awake) on the GPU under Zipf
#                               traffic, launchers + guard + gateway (tools/gpu-validate/sleep_scale.py)
set -euo pipefail
VF=/root/vf
PARTS=/root/parts
SITE=${SITE:-/tmp/site}  # sandbox_run.py: /opt/vllm-fleet/site (PrivateTmp= hides /tmp)
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "$1" in
stash)
  mkdir -p $PARTS && cp "$2"/bundle.part-* $PARTS/ && ls -la $PARTS && df -h /root | tail -1 ;;
install)
  t=$(date +%s)
  rm -rf $VF/b && mkdir -p $VF/b $VF/log $VF/venv/bin $VF/models
  cat $PARTS/bundle.part-* | tar -xf - -C $VF/b
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE $VF/b/deps/*.whl
  python3 -m zipfile -e $VF/b/vllm-*.whl $SITE
  for d in $VF/b/nginx/*.deb; do dpkg -x "$d" $VF/nginx; done
  rm -rf $VF/models/qwen3-8b && cp -r $VF/b/model $VF/models/qwen3-8b
  # the spec's engine command is $venv/bin/vllm: a launcher script for the carried vLLM
  cat > $VF/venv/bin/vllm <<PYEOF
#!$(command -v python3)
import sys
sys.path.insert(0, "$SITE")
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
PYEOF
  chmod +x $VF/venv/bin/vllm
  echo "install took $(( $(date +%s) - t ))s"
  (ldd $VF/nginx/usr/sbin/nginx | grep "not found") || echo "nginx: all libraries found"
  python3 -c "import vllm, torch, pydantic, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'pydantic', pydantic.__version__, 'transformers', transformers.__version__)"
  ;;
start-bare)
  python3 tools/gpu-validate/measure.py start-bare "${2:-480}" ;;
measure)
  python3 tools/gpu-validate/measure.py measure "$2" ;;
churn)
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # 2,000 client connections + the gateway's
  exec python3 tools/gpu-validate/churn.py "$2" ;;  # exec: a `timeout` TERM reaches it
classes)
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # 204 client connections + the gateway's
  exec python3 tools/gpu-validate/classes.py "$2" ;;  # exec: a `timeout` TERM reaches it
lora-fleet)
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # 384 client connections + the gateway's
  exec python3 tools/gpu-validate/lora_fleet.py "$2" ;;  # exec: a `timeout` TERM reaches it
sleep-fleet)
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # 64 client connections per round + the gateway's
  exec python3 tools/gpu-validate/sleep_fleet.py "$2" ;;  # exec: a `timeout` TERM reaches it
sleep-scale)
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # 16 lanes + the gateway's connections
  exec python3 tools/gpu-validate/sleep_scale.py "${@:2}" ;;  # OUT [flags]; exec: a `timeout` TERM reaches it
*) echo "usage: $0 stash DIR | install | start-bare [WAIT] | measure OUT | churn OUT | classes OUT | lora-fleet OUT | sleep-fleet OUT | sleep-scale OUT" >&2; exit 2 ;;
esac
