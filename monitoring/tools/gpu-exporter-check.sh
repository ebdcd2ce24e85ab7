#!/bin/bash
# NVML check of the host exporter on a GPU machine (used with the device tool on an H200, see
# docs/perf/observability.md). Needs wheels for prometheus-client, nvidia-ml-py, pydantic, pyyaml, jinja2 in
# .obs-wheels/ (pip download --python-version 3.12 --only-binary=:all: ... -d .obs-wheels) and torch for load.
set -x
python3 --version; nvidia-smi --query-gpu=name,driver_version --format=csv
pip install -q --no-index --find-links .obs-wheels --target /tmp/site prometheus-client nvidia-ml-py pydantic pyyaml jinja2 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/st && cat > /tmp/st/qwen3.json <<'J'
{"instance": "qwen3", "served_model_name": "qwen3-8b", "port": 8001, "state": "ready", "load_duration_seconds": 30.1, "last_probe_ok": true, "last_probe_latency_seconds": 0.07, "probes_total": 3, "probe_failures_total": 0, "updated_at": 1.0}
J
python3 - <<'P' &
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t = time.time()
while time.time() - t < 25:
    b = a @ a
torch.cuda.synchronize()
P
LOAD=$!
sleep 8
python3 - <<'P' > $OUT/exporter-once.txt 2> $OUT/exporter-once.err
import argparse
from prometheus_client import generate_latest
from vllm_fleet.host.exporter import build_registry
a = argparse.Namespace(state_dir="/tmp/st", config_dir="/nonexistent", access_log="", access_log_from_start=False, no_nvml=False)
print(generate_latest(build_registry(a)).decode(), end="")
P
nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw,power.limit,ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total --format=csv > $OUT/nvidia-smi.csv
# the served exporter (HTTP), as the unit runs it
python3 - <<'P' > $OUT/exporter-http.txt 2>&1
import threading, time, urllib.request, argparse
from prometheus_client import start_http_server
from vllm_fleet.host.exporter import build_registry
a = argparse.Namespace(state_dir="/tmp/st", config_dir="/nonexistent", access_log="", access_log_from_start=False, no_nvml=False)
server, t = start_http_server(19400, addr="127.0.0.1", registry=build_registry(a))
time.sleep(1)
body = urllib.request.urlopen("http://127.0.0.1:19400/metrics").read().decode()
print("\n".join(l for l in body.splitlines() if l.startswith("vllm_fleet_gpu") or "instance_state{" in l))
server.shutdown()
P
wait $LOAD
cat $OUT/exporter-once.err | tail -5
grep -c "^vllm_fleet_gpu" $OUT/exporter-once.txt
grep "^vllm_fleet_gpu" $OUT/exporter-once.txt
python3 - <<'P'
import pynvml as nv, time
nv.nvmlInit(); h = nv.nvmlDeviceGetHandleByIndex(0)
es = nv.nvmlEventSetCreate()
try:
    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es); print("XID events: registered")
except nv.NVMLError as e:
    print("XID events:", e)
print("mem v1 used", nv.nvmlDeviceGetMemoryInfo(h).used, "v2 used", nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2).used)
P
cat $OUT/nvidia-smi.csv
