#!/usr/bin/env bash
# Build the FlashInfer calibration anchors for the static SASS speed model: compile
# FlashInfer's own attention kernels (CUDA-core paged decode f16 for GQA groups 4 and 8,
# and fp8-e4m3 KV; tensor-core decode; FA2 batch prefill paged and ragged, causal and not)
# from the headers in the flashinfer-python wheel with nvcc from NVIDIA's PyPI wheels, one
# cubin per kernel, then disassemble each cubin and keep its ptxas resource report.
#
#   scripts/build-anchors.sh           rebuild and rewrite ptx/anchors/flashinfer/*.sass, *.res.txt
#   scripts/build-anchors.sh --check   rebuild into a temporary folder and fail if the committed
#                                      SASS / resource files differ from what the build gives
#
# Inputs: the instantiation files ptx/anchors/flashinfer/src/*.cu (one __global__ kernel
# each, with the template arguments FlashInfer's dispatchers pick, cited there) and the
# configs rendered from the wheel's JIT templates (src/*.inc). The flags are those of
# FlashInfer's JIT (flashinfer/jit/core.py gen_jit_spec, flashinfer/jit/cpp_ext.py
# build_cuda_cflags, flashinfer/compilation_context.py), see ptx/anchors/flashinfer/README.md.
# Outputs, in ptx/anchors/flashinfer/: <kernel>.<arch>.sass (nvdisasm -hex -c, both 64-bit
# words of every instruction, runs of blanks squeezed to one space to keep the files small)
# and <kernel>.<arch>.res.txt (ptxas -v lines for that kernel, minus its compile time).
# The cubins and nvcc logs stay in the ignored folder .tools/anchors-build/.
# Set PAGEDKV_ANCHOR_ALL_SASS=1 to also write the SASS files left out by default (see SKIP_SASS).
#
# Wheels (pinned with their sha256 below) are downloaded with pip into the ignored folder
# .tools/ and unpacked there: no CUDA toolkit and no GPU is needed, only python3 -m pip,
# unzip and a host C++ compiler nvcc accepts (g++ 12 here).
set -euo pipefail

FLASHINFER_VERSION=0.7.4
CUDA_WHEEL_VERSION=13.5.37      # nvidia-cuda-nvcc, nvidia-nvvm (cicc, libdevice), nvidia-cuda-crt, nvidia-cuda-runtime
CCCL_WHEEL_VERSION=13.3.5.0.6   # nvidia-cuda-cccl (the toolkit's cuda/std, cub, thrust)
NVDISASM_WHEEL_VERSION=13.5.37  # the same nvdisasm scripts/validate-ptx.sh uses

# sha256 of every wheel, as downloaded from PyPI.
declare -A WHEEL_SHA256=(
  [flashinfer_python-0.7.4-py3-none-any.whl]=a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32
  [nvidia_cuda_nvcc-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl]=f5c4f7ead5d964fb4af42bbf1e6d3ec3c1e6e9d83b53749f691d387e7fcaa3a7
  [nvidia_nvvm-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl]=c41bfa362e407405163f103c2229f0765f8cc2ed7d148b754dc77f228bf7e070
  [nvidia_cuda_crt-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl]=e898b7f73d3035fa89915a3f7bf3b54a73e90249746111aed295822c4729bb29
  [nvidia_cuda_runtime-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl]=df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d
  [nvidia_cuda_cccl-13.3.5.0.6-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl]=d5230098fa2df5021e1a00c0c4eee41797671a91119d31e892463e5ccf3ee326
  [nvidia_cuda_nvdisasm-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl]=d3fdbdd49fa53e2e4aacd3db8259d052bd2b049ececdcb69e92e083c6728e7ca
)

# Kernels (src/<name>.cu) and targets. FlashInfer's JIT builds sm_90a for an H100
# (compilation_context.py _normalize_cuda_arch) and sm_80 for an A100.
KERNELS=(decode_f16 decode_f16_g8 decode_e4m3kv decode_tc_f16 prefill_paged_causal
         prefill_paged_nomask prefill_ragged_causal prefill_ragged_nomask)
ARCHS=(90a 80)
# SASS not committed by default, to keep ptx/anchors/ near 3 MB: fp8 KV on sm_80 has no
# hardware e4m3 conversion (1.7 MB of SASS), and the sm_80 ragged prefill kernels.
# Their .res.txt files are always written.
SKIP_SASS=" decode_e4m3kv.sm_80 prefill_ragged_causal.sm_80 prefill_ragged_nomask.sm_80 "

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

mode=write
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

ANCHORS=ptx/anchors/flashinfer
DL=.tools/dl
mkdir -p "$DL"

# fetch_wheel PKG VERSION DEST MEMBER...: download PKG==VERSION (if not already in .tools/dl),
# check its sha256 and unzip the given members into DEST.
fetch_wheel() {
  local pkg=$1 ver=$2 dest=$3
  shift 3
  local whl=
  for f in "$DL/${pkg//-/_}-$ver-"*.whl; do [ -e "$f" ] && whl=$f; done
  if [ -z "$whl" ]; then
    echo "build-anchors: downloading $pkg==$ver" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$DL" "$pkg==$ver"
    for f in "$DL/${pkg//-/_}-$ver-"*.whl; do [ -e "$f" ] && whl=$f; done
  fi
  local name want got
  name=$(basename "$whl")
  want=${WHEEL_SHA256[$name]:-}
  got=$(sha256sum "$whl" | cut -d' ' -f1)
  if [ -z "$want" ] || [ "$want" != "$got" ]; then
    echo "build-anchors: $name has sha256 $got, expected ${want:-<no pin>}" >&2
    exit 1
  fi
  mkdir -p "$dest"
  unzip -q -o "$whl" "$@" -d "$dest"
}

# The CUDA 13 compiler: nvcc, ptxas, cudafe++, fatbinary (nvidia-cuda-nvcc), cicc and
# libdevice (nvidia-nvvm: nvcc.profile looks for them in nvvm/bin and nvvm/libdevice),
# crt/*.h (nvidia-cuda-crt), cuda_runtime.h, cuda_fp16.h, cuda_fp8.h, cooperative_groups
# (nvidia-cuda-runtime) and CCCL (nvidia-cuda-cccl, include/cccl, which nvcc.profile puts on
# the system include path), all under one nvidia/cu13 prefix, like a toolkit install.
CUDA=.tools/cuda-$CUDA_WHEEL_VERSION
CU13=$CUDA/nvidia/cu13
if [ ! -x "$CU13/bin/nvcc" ] || [ ! -x "$CU13/nvvm/bin/cicc" ] || [ ! -f "$CU13/include/cuda_runtime.h" ] \
   || [ ! -f "$CU13/include/crt/host_config.h" ] || [ ! -d "$CU13/include/cccl/cuda/std" ]; then
  fetch_wheel nvidia-cuda-nvcc "$CUDA_WHEEL_VERSION" "$CUDA" 'nvidia/*'
  fetch_wheel nvidia-nvvm "$CUDA_WHEEL_VERSION" "$CUDA" 'nvidia/*'
  fetch_wheel nvidia-cuda-crt "$CUDA_WHEEL_VERSION" "$CUDA" 'nvidia/*'
  fetch_wheel nvidia-cuda-runtime "$CUDA_WHEEL_VERSION" "$CUDA" 'nvidia/*'
  fetch_wheel nvidia-cuda-cccl "$CCCL_WHEEL_VERSION" "$CUDA" 'nvidia/*'
  chmod +x "$CU13"/bin/* "$CU13/nvvm/bin/cicc"
fi
NVCC=$CU13/bin/nvcc

# FlashInfer's headers and its vendored CCCL (flashinfer/jit/env.py FLASHINFER_INCLUDE_DIR,
# CCCL_INCLUDE_DIRS).
FI=.tools/flashinfer-python-$FLASHINFER_VERSION
FI_DATA=$FI/flashinfer/data
if [ ! -f "$FI_DATA/include/flashinfer/attention/prefill.cuh" ] || [ ! -d "$FI_DATA/cccl/libcudacxx/include" ]; then
  fetch_wheel flashinfer-python "$FLASHINFER_VERSION" "$FI" \
    'flashinfer/data/include/*' 'flashinfer/data/cccl/*'
fi

DTOOLS=.tools/cuda-nvdisasm-$NVDISASM_WHEEL_VERSION
NVDISASM=$DTOOLS/nvidia/cu13/bin/nvdisasm
if [ ! -x "$NVDISASM" ]; then
  fetch_wheel nvidia-cuda-nvdisasm "$NVDISASM_WHEEL_VERSION" "$DTOOLS" 'nvidia/cu13/bin/nvdisasm'
  chmod +x "$NVDISASM"
fi

# nvcc flags, in the order FlashInfer's JIT emits them for a head_dim-128 FA2 decode/prefill
# module (flashinfer/jit/cpp_ext.py build_common_cflags + build_cuda_cflags, with the global
# arch flags of flashinfer/compilation_context.py and gen_jit_spec's flags from
# flashinfer/jit/core.py, non-debug). -cubin (device code only) replaces the JIT's -c, and
# -Xptxas -v is added for the resource report; neither changes the generated code. Left out:
# host-only flags (--compiler-options=-fPIC, -D_GLIBCXX_USE_CXX11_ABI, -DPy_LIMITED_API,
# --generate-dependencies-with-compile) and the include folders no anchor source reaches
# (flashinfer/data/csrc, cutlass, spdlog, tvm-ffi, python; checked with nvcc -M).
common_flags=(
  -I"$FI_DATA/cccl/cub" -I"$FI_DATA/cccl/libcudacxx/include" -I"$FI_DATA/cccl/thrust"
  -isystem "$FI_DATA/include"
  --expt-relaxed-constexpr -static-global-template-stub=false
)
jit_flags=(
  -DFLASHINFER_ENABLE_FP8_E8M0 -DFLASHINFER_ENABLE_FP4_E2M1
  -std=c++17 --threads=1 -use_fast_math -Xfatbin=-compress-all --compress-mode=size
  -DFLASHINFER_ENABLE_F16 -DFLASHINFER_ENABLE_BF16 -DFLASHINFER_ENABLE_FP8_E4M3
  -DFLASHINFER_ENABLE_FP8_E5M2 -DNDEBUG -O3
)

BUILD=.tools/anchors-build
rm -rf "$BUILD"
mkdir -p "$BUILD"
if [ "$mode" = check ]; then
  OUTDIR=$(mktemp -d)
  trap 'rm -rf "$OUTDIR"' EXIT
else
  OUTDIR=$ANCHORS
fi

# build_one KERNEL ARCH: compile src/KERNEL.cu for sm_ARCH into one cubin, write its SASS
# and resource report. Runs in the background; its status goes to $BUILD/KERNEL.sm_ARCH.rc.
build_one() {
  set +e
  local k=$1 a=$2
  local tag=$k.sm_$a
  local t0 t1 rc=0
  t0=$(date +%s.%N)
  "$NVCC" -cubin -o "$BUILD/$tag.cubin" "${common_flags[@]}" \
    "-gencode=arch=compute_$a,code=sm_$a" "${jit_flags[@]}" -Xptxas -v \
    "$ANCHORS/src/$k.cu" > "$BUILD/$tag.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  if [ $rc -eq 0 ]; then
    # ptxas -v: "Compiling entry function 'NAME' for 'ARCH'", "Function properties for NAME",
    # "N bytes stack frame, N bytes spill stores, N bytes spill loads", "Used N registers, ...".
    grep -E "^ptxas info|^ +[0-9]+ bytes stack frame" "$BUILD/$tag.log" \
      | grep -v "Compile time" > "$OUTDIR/$tag.res.txt"
    if [ "${PAGEDKV_ANCHOR_ALL_SASS:-0}" = 1 ] || [[ "$SKIP_SASS" != *" $tag "* ]]; then
      "$NVDISASM" -hex -c "$BUILD/$tag.cubin" | sed -E 's/[[:space:]]+/ /g; s/ $//' \
        > "$OUTDIR/$tag.sass" || rc=$?
    fi
  fi
  printf '%s %s %.1f\n' "$tag" "$rc" "$(echo "$t1 - $t0" | bc)" > "$BUILD/$tag.rc"
}

JOBS=${JOBS:-$(nproc)}
echo "build-anchors: $("$NVCC" --version | tail -2 | head -1), $JOBS parallel jobs" >&2
start=$(date +%s.%N)
for a in "${ARCHS[@]}"; do
  for k in "${KERNELS[@]}"; do
    build_one "$k" "$a" &
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  done
done
wait
total=$(echo "$(date +%s.%N) - $start" | bc)

bad=0
for a in "${ARCHS[@]}"; do
  for k in "${KERNELS[@]}"; do
    tag=$k.sm_$a
    read -r _ rc secs < "$BUILD/$tag.rc"
    if [ "$rc" != 0 ]; then
      cat "$BUILD/$tag.log" >&2
      echo "build-anchors: $tag failed (rc $rc)" >&2
      bad=1
      continue
    fi
    regs=$(grep -oE "Used [0-9]+ registers" "$OUTDIR/$tag.res.txt" | grep -oE "[0-9]+")
    spill=$(grep -oE "[0-9]+ bytes spill stores" "$OUTDIR/$tag.res.txt" | grep -oE "^[0-9]+")
    echo "build-anchors: $tag: ${secs}s nvcc, $regs registers, $spill bytes spill stores" >&2
  done
done
[ $bad -eq 0 ] || exit 1
printf 'build-anchors: %d cubins in %.1fs wall\n' $(( ${#KERNELS[@]} * ${#ARCHS[@]} )) "$total" >&2

if [ "$mode" = check ]; then
  stale=0
  for f in "$OUTDIR"/*; do
    if ! cmp -s "$f" "$ANCHORS/$(basename "$f")"; then
      echo "build-anchors --check: $ANCHORS/$(basename "$f") is stale or missing" >&2
      stale=1
    fi
  done
  for f in "$ANCHORS"/*.sass "$ANCHORS"/*.res.txt; do
    if [ ! -e "$OUTDIR/$(basename "$f")" ]; then
      echo "build-anchors --check: $f is not produced by the build" >&2
      stale=1
    fi
  done
  [ $stale -eq 0 ] || { echo "build-anchors --check: run scripts/build-anchors.sh" >&2; exit 1; }
  echo "build-anchors --check: $ANCHORS is current"
else
  echo "build-anchors: wrote $ANCHORS/*.sass and *.res.txt"
fi
