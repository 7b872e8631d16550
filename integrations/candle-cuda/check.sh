#!/usr/bin/env bash
# cargo check of candle-core with `cuda` next to pagedkv. candle's build compiles its
# CUDA kernels with nvcc: this takes nvcc 13.0 from PyPI wheels (nvidia-cuda-nvcc, -nvvm
# for cicc, -cuda-crt, -cuda-runtime, -cuda-cccl; about 100 MB) into the ignored
# .tools/nvcc-13.0. No GPU needed. Not in CI: about 15 minutes cold on the 2-core dev
# machine. Extra arguments go to cargo check.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
root="$(cd ../.. && pwd)/.tools/nvcc-13.0"
cu="$root/nvidia/cu13"
if [ ! -x "$cu/bin/nvcc" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" -d "$tmp"
  mkdir -p "$root"
  for w in "$tmp"/*.whl; do python3 -m zipfile -e "$w" "$root"; done
  chmod +x "$cu"/bin/* "$cu"/nvvm/bin/*
  rm -rf "$tmp"
fi
# bindgen_cuda (candle-kernels' build) asks nvidia-smi for the compute capability
# unless CUDA_COMPUTE_CAP says it.
export PATH="$cu/bin:$PATH" CUDA_HOME="$cu" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
nvcc --version | tail -2
cargo check --locked "$@"
