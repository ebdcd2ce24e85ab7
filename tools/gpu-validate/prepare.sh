#!/bin/bash
# Local side of the GPU validation (docs/gpu-validation.md): build what travels to the H200 machine.
# Needs network access to the package registries (pip, apt) here; the device has none.
# Output (git-ignored): .gpu/p1 … .gpu/p4, each one carried by one device call (64 MiB limit with the tree).
set -euo pipefail
cd "$(dirname "$0")/../.."
G=.gpu
VLLM=vllm==0.21.0            # pins torch==2.11.0, the device image's torch
rm -rf $G/bundle/deps  # one version of each wheel: two of one package stop pip --target
mkdir -p $G/whl $G/bundle/deps $G/bundle/nginx
# 1. the official wheel, slimmed: FA2 and the MoE kernels are not used by a dense bf16 model on Hopper
#    (vLLM picks FA3 on cc 9.0; both imports are optional), nor deep_gemm's sources and other-Python builds
[ -n "$(ls $G/whl/vllm-0.21.0-*.whl 2>/dev/null)" ] || python3 -m pip download --no-deps -d $G/whl $VLLM
w=$(ls $G/whl/vllm-0.21.0-*.whl); slim=$G/bundle/$(basename "$w")
if [ ! -f "$slim" ]; then
  cp "$w" "$slim"
  zip -q -d "$slim" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C.abi3.so' \
    'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*' 'vllm/third_party/deep_gemm/include/*'
fi
# 2. the deps the image lacks, as Python 3.12 manylinux wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
  -d $G/bundle/deps -r tools/gpu-validate/deps-py312.txt
# 3. nginx + njs as Debian packages, unpacked there with dpkg -x (no apt on the device)
(cd $G/bundle/nginx && [ -n "$(ls ./*.deb 2>/dev/null)" ] || apt-get download nginx nginx-common libnginx-mod-http-js)
# 4. the Qwen3-8B-shaped model folder (config + padded tokenizer; weights come from --load-format dummy);
#    MODEL_PY: a Python with `tokenizers` (e.g. the repo venv's) where python3 lacks it
[ -f $G/bundle/model/config.json ] || ${MODEL_PY:-python3} tools/gpu-validate/make_model.py $G/bundle/model
# 5. one tar, split into parts that fit one call each (working tree ≈ 2.5 MiB + 45 MiB < 64 MiB)
rm -rf $G/p[0-9] && mkdir -p $G/split
tar -cf - -C $G/bundle . | split -b 45M -d -a 1 - $G/split/bundle.part-
i=1; for f in $G/split/bundle.part-*; do mkdir -p $G/p$i && mv "$f" $G/p$i/; i=$((i+1)); done
rmdir $G/split; du -sh $G/p*
