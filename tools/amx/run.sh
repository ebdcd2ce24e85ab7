#!/usr/bin/env bash
# Show the AMX permission rule on the machine it runs on (run from the repository root):
# the CPU's flags, an AMX instruction without and with the permission request, and what vllm-fleet's own
# request (vllm_fleet/host/cpu_features.py, made by every engine process) returns there.
set -u
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
echo "kernel: $(uname -r)"
echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|amx_[a-z0-9]+)$' | tr '\n' ' ')"
py=${PYTHON:-python3}
echo "vllm-fleet request_amx(): $(PYTHONPATH=. "$py" -c 'from vllm_fleet.host.cpu_features import request_amx; print(request_amx())')"
if ! grep -qw amx_tile /proc/cpuinfo; then echo "no AMX on this CPU: nothing to show"; exit 0; fi
d=$(mktemp -d)
gcc -O1 -mamx-tile -o "$d/probe" tools/amx/amx_tile_probe.c || exit 1
echo "--- without the request:"; "$d/probe"; echo "exit status $? (132 = 128 + SIGILL)"
echo "--- with the request:"; "$d/probe" --request; echo "exit status $?"
rm -rf "$d"
