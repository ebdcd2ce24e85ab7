#!/bin/bash
# Cache-aware vs least_conn routing on one H200 (issue 20, GPU part): four replicas of the Qwen3-8B-shaped
# dummy model on GPU 0, each with a small KV cache and prefix caching, behind two nginx gateways (least_conn /
# cache_aware) over the same four engines; `vllm-fleet bench --compare` with the shared-prefix profile
# (tools/gpu-validate/shared-prefix-gpu.yml), interleaved rounds; TTFT p50/p95/p99, output tok/s and the
# fleet-wide prefix-cache hit rate per round (tools/prefix_routing_bench.py --attach).
#
# Device side, from the repo root, after `tools/gpu-validate/run-device.sh install` (the carried vLLM in
# $SITE, the model in /root/vf/models/qwen3-8b, nginx + njs unpacked under /root/vf/nginx):
#   prefix-routing.sh check     what is there: vLLM, the flags it needs, nginx + njs (exit 3 if nginx is not)
#   prefix-routing.sh start     the four engines (own sessions: they outlive the call), wait until healthy
#   prefix-routing.sh bench OUT the interleaved compare (≈ 2 × ROUNDS × ROUND_S + warm-up), results in OUT
#   prefix-routing.sh stop      stop the engines
# Settings (environment): ROUNDS=3 ROUND_S=50 KV_BYTES=7516192768 (7 GiB per replica) GPU_UTIL=0.2
#   MAX_CONNS=32 (routing.max_conns: 2 × the fair share of 64 users over 4) CONCURRENCY=64 MAX_LEN=8192 MAX_SEQS=64 REPLICAS=4
set -euo pipefail
VF=/root/vf
SITE=${SITE:-/tmp/site}
W=$VF/prefix-routing
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
REPLICAS=${REPLICAS:-4}; KV_BYTES=${KV_BYTES:-7516192768}; GPU_UTIL=${GPU_UTIL:-0.2}
MAX_LEN=${MAX_LEN:-8192}; MAX_SEQS=${MAX_SEQS:-64}; MAX_CONNS=${MAX_CONNS:-32}
ROUNDS=${ROUNDS:-3}; ROUND_S=${ROUND_S:-50}; CONCURRENCY=${CONCURRENCY:-64}
NGINX=$VF/nginx/usr/sbin/nginx
JS=$VF/nginx/usr/lib/nginx/modules/ngx_http_js_module.so
VLLM=$VF/venv/bin/vllm
mkdir -p $W

nginx_ok() {
  if [ ! -x "$NGINX" ] && command -v nginx >/dev/null; then NGINX=$(command -v nginx); JS=/usr/lib/nginx/modules/ngx_http_js_module.so; fi
  if [ ! -x "$NGINX" ] || [ ! -f "$JS" ]; then
    echo "nginx + njs: NOT AVAILABLE (looked for $VF/nginx/usr/sbin/nginx and nginx on PATH, and $JS)." >&2
    echo "  Carry the bundle's nginx .debs (tools/gpu-validate/prepare.sh) and run run-device.sh install first." >&2
    return 3
  fi
  echo "nginx: $NGINX ($("$NGINX" -v 2>&1)); njs module: $JS"
}

kv_flag() {  # --kv-cache-memory-bytes where this vLLM has it, else size by --gpu-memory-utilization
  if $VLLM serve --help=all 2>/dev/null | grep -q -- '--kv-cache-memory-bytes'; then
    echo "--kv-cache-memory-bytes $KV_BYTES --gpu-memory-utilization $GPU_UTIL"
  else
    echo "--gpu-memory-utilization $GPU_UTIL"
  fi
}

case "${1:-}" in
check)
  python3 -c "import vllm; print('vllm', vllm.__version__)"
  echo "KV flags: $(kv_flag)"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  nginx_ok ;;
start)
  nginx_ok
  flags=$(kv_flag)
  urls=()
  for i in $(seq 0 $((REPLICAS - 1))); do
    port=$((8101 + i))
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 VLLM_CACHE_ROOT=$W/cache-$i setsid nohup $VLLM serve $VF/models/qwen3-8b \
      --load-format dummy --dtype bfloat16 --host 127.0.0.1 --port $port --served-model-name qwen3-8b \
      --max-model-len $MAX_LEN --max-num-seqs $MAX_SEQS --enable-prefix-caching $flags \
      > $W/engine-$i.log 2>&1 < /dev/null &
    echo $! > $W/engine-$i.pid
    urls+=("\"http://127.0.0.1:$port\"")
    sleep 20  # staggered: each start profiles the GPU's free memory
  done
  echo "{\"engines\": [$(IFS=,; echo "${urls[*]}")], \"reference\": null}" > $W/engines.json
  t=$(date +%s)
  for i in $(seq 0 $((REPLICAS - 1))); do
    until curl -sf http://127.0.0.1:$((8101 + i))/health >/dev/null; do
      if ! kill -0 "$(cat $W/engine-$i.pid)" 2>/dev/null; then echo "engine $i died:"; tail -30 $W/engine-$i.log; exit 1; fi
      if [ $(( $(date +%s) - t )) -gt 540 ]; then echo "engine $i not healthy after 540 s"; tail -30 $W/engine-$i.log; exit 1; fi
      sleep 3
    done
    echo "engine $i healthy after $(( $(date +%s) - t )) s"
  done
  grep -h "KV cache\|GPU blocks\|Maximum concurrency" $W/engine-*.log | tail -8 || true
  nvidia-smi --query-gpu=memory.used --format=csv
  cat $W/engines.json ;;
bench)
  OUT=${2:?OUT}
  mkdir -p "$OUT"
  nginx_ok
  python3 tools/prefix_routing_bench.py --attach $W/engines.json --replicas $REPLICAS --model qwen3-8b \
    --nginx "$NGINX" --js-module "$JS" --workdir "$OUT" --profile tools/gpu-validate/shared-prefix-gpu.yml \
    --rounds $ROUNDS --round-duration $ROUND_S --concurrency $CONCURRENCY --max-conns $MAX_CONNS
  cp $W/engine-*.log "$OUT"/ 2>/dev/null || true ;;
stop)
  for f in $W/engine-*.pid; do [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done ;;
*) echo "usage: $0 check | start | bench OUT | stop" >&2; exit 2 ;;
esac
