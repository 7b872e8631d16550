#!/usr/bin/env bash
# Assemble every committed PTX file with ptxas for its architecture, disassemble the
# cubin with nvdisasm, write the resource report ptx/resources.md, and fail if any kernel
# has a stack frame or spills, if the decode kernels' SASS does not stage K/V through
# cp.async (LDGSTS) with fused multiply-adds (scripts/sass-check.py). The performance
# model of decode and of the multi-warp prefill (scripts/decode-model.py reads each such
# kernel's steady-state loop from the SASS, examples/decode_model.rs applies its bounds)
# is appended to the report; with PAGEDKV_ENFORCE_MODEL=1 a missed bar of issue #29 or
# #30 fails the script.
#
#   scripts/validate-ptx.sh           validate and rewrite ptx/resources.md
#   scripts/validate-ptx.sh --check   validate and fail if ptx/resources.md is stale
#
# PAGEDKV_MODEL_KEEP=DIR keeps the model's inputs (ptxas.txt, loops.txt, the SASS) in DIR,
# to rerun `cargo run --release --example decode_model -- DIR/ptxas.txt DIR/loops.txt
# ptx/anchors/flashinfer` while working on a kernel or the model.
#
# ptxas and nvdisasm come from PyPI (nvidia-cuda-nvcc-cu12 and nvidia-cuda-nvdisasm,
# pinned below), unpacked into the ignored folder .tools/: no CUDA toolkit is needed.
set -euo pipefail

NVCC_WHEEL_VERSION=12.9.86
NVDISASM_WHEEL_VERSION=13.5.37
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

mode=write
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

TOOLS=.tools/cuda-nvcc-$NVCC_WHEEL_VERSION
PTXAS=$TOOLS/nvidia/cuda_nvcc/bin/ptxas
if [ ! -x "$PTXAS" ]; then
  echo "validate-ptx: installing ptxas from nvidia-cuda-nvcc-cu12==$NVCC_WHEEL_VERSION" >&2
  mkdir -p .tools/dl "$TOOLS"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
    -d .tools/dl "nvidia-cuda-nvcc-cu12==$NVCC_WHEEL_VERSION"
  unzip -q -o .tools/dl/nvidia_cuda_nvcc_cu12-"$NVCC_WHEEL_VERSION"-*.whl \
    'nvidia/cuda_nvcc/bin/ptxas' -d "$TOOLS"
  chmod +x "$PTXAS"
fi

DTOOLS=.tools/cuda-nvdisasm-$NVDISASM_WHEEL_VERSION
NVDISASM=$DTOOLS/nvidia/cu13/bin/nvdisasm
if [ ! -x "$NVDISASM" ]; then
  echo "validate-ptx: installing nvdisasm from nvidia-cuda-nvdisasm==$NVDISASM_WHEEL_VERSION" >&2
  mkdir -p .tools/dl "$DTOOLS"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .tools/dl "nvidia-cuda-nvdisasm==$NVDISASM_WHEEL_VERSION"
  unzip -q -o .tools/dl/nvidia_cuda_nvdisasm-"$NVDISASM_WHEEL_VERSION"-*.whl \
    'nvidia/cu13/bin/nvdisasm' -d "$DTOOLS"
  chmod +x "$NVDISASM"
fi

report=$(mktemp)
log=$(mktemp)
work=$(mktemp -d)
trap 'rm -rf "$report" "$log" "$work"' EXIT
sass_rows=""

{
  echo "# PTX resource report"
  echo
  echo "Written by \`scripts/validate-ptx.sh\` from \`ptxas -v\` ($("$PTXAS" --version | tail -1))."
  echo "Every kernel must show 0 bytes stack frame and 0 bytes spill stores/loads."
  echo
  echo "| arch | kernel | registers | static shared (bytes) | stack frame (bytes) | spill stores (bytes) | spill loads (bytes) |"
  echo "|---|---|---|---|---|---|---|"
} > "$report"

bad=0
shopt -s nullglob
files=(ptx/pagedkv_kernels.sm_*.ptx)
if [ ${#files[@]} -eq 0 ]; then
  echo "validate-ptx: no PTX under ptx/; run scripts/build-ptx.sh" >&2
  exit 1
fi
for f in "${files[@]}"; do
  arch=${f##*.sm_}; arch=sm_${arch%.ptx}
  if ! "$PTXAS" -arch="$arch" -v -o "$work/$arch.cubin" "$f" 2> "$log"; then
    cat "$log" >&2
    echo "validate-ptx: ptxas rejected $f" >&2
    exit 1
  fi
  # ptxas -v prints, per entry: "Compiling entry function 'NAME' for 'ARCH'",
  # "N bytes stack frame, N bytes spill stores, N bytes spill loads",
  # "Used N registers, ... N bytes smem, ...".
  rows=$(awk -v arch="$arch" '
    /Compiling entry function/ { match($0, /'\''[^'\'']+'\''/); name = substr($0, RSTART+1, RLENGTH-2); stack=spst=spld=regs=smem="?" }
    /bytes stack frame/ { for (i=1;i<=NF;i++) { if ($(i+1)=="bytes" && $(i+2)=="stack") stack=$i; if ($(i+2)=="spill" && $(i+3)=="stores,") spst=$i; if ($(i+2)=="spill" && $(i+3)=="loads") spld=$i } }
    /Used [0-9]+ registers/ { for (i=1;i<=NF;i++) { if ($(i+1)=="registers,") regs=$i; if ($(i+1)=="bytes" && $(i+2) ~ /^smem/) smem=$i }
                              if (smem=="?") smem=0
                              printf "| %s | %s | %s | %s | %s | %s | %s |\n", arch, name, regs, smem, stack, spst, spld
                              printf "arch=%s kernel=%s registers=%s shared=%s stack=%s\n", arch, name, regs, smem, stack > kv }
  ' kv="$work/ptxas.$arch.txt" "$log")
  if [ -z "$rows" ]; then
    cat "$log" >&2
    echo "validate-ptx: could not read ptxas's report for $f" >&2
    exit 1
  fi
  echo "$rows" | LC_ALL=C sort >> "$report"
  while IFS='|' read -r _ a k _ _ st ss sl _; do
    if [ "$(echo "$st$ss$sl" | tr -d ' ')" != "000" ]; then
      echo "validate-ptx: $a$k has a stack frame or spills (stack$st, spill stores$ss, spill loads$sl)" >&2
      bad=1
    fi
  done <<< "$rows"
  echo "validate-ptx: $f assembles for $arch ($(echo "$rows" | wc -l) kernels)"

  # The decode kernels' SASS: K/V through LDGSTS, FFMA, a cp.async wait.
  "$NVDISASM" -c "$work/$arch.cubin" > "$work/$arch.sass" 2> "$log" || {
    cat "$log" >&2; echo "validate-ptx: nvdisasm failed on $arch" >&2; exit 1; }
  if ! rows=$(python3 scripts/sass-check.py "$arch" "$work/$arch.sass"); then
    echo "$rows" >&2
    echo "validate-ptx: the decode kernels' SASS for $arch fails its checks" >&2
    bad=1
  fi
  sass_rows+="$rows"$'\n'
  # The model reads the control codes (stall counts, scoreboards): -hex keeps both
  # 64-bit words of every instruction.
  "$NVDISASM" -c -hex "$work/$arch.cubin" > "$work/$arch.hex.sass" 2> "$log" || {
    cat "$log" >&2; echo "validate-ptx: nvdisasm -hex failed on $arch" >&2; exit 1; }
  python3 scripts/decode-model.py "$arch" "$work/$arch.hex.sass" >> "$work/loops.txt"
  cat "$work/ptxas.$arch.txt" >> "$work/ptxas.txt"
done

{
  echo
  echo "## Attention kernels' SASS (nvdisasm -c, $("$NVDISASM" --version | tail -1))"
  echo
  echo "K and V are staged with cp.async (LDGSTS, 16 bytes, bypassing L1); in decode the only 16-byte plain global loads (LDG.128) are the query's (at most 2 per thread); DEPBAR is the cp.async wait. The f16/bf16 prefill kernels run on tensor cores: HMMA.16816 with LDSM (ldmatrix) fragments."
  echo
  echo "| arch | kernel | LDGSTS.128 | LDG.128 | DEPBAR | FFMA | MUFU.EX2 | check |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s' "$sass_rows"
} >> "$report"

# The anchors: FlashInfer's kernels, their committed SASS (nvdisasm -c -hex), each
# file's stage loop under its file's stem.
for f in ptx/anchors/flashinfer/*.sm_90a.sass; do
  name=$(basename "$f" .sm_90a.sass)
  python3 scripts/decode-model.py --anchor "$name" sm_90 "$f" >> "$work/loops.txt"
done

# The model: ptxas's resources (by name), the loops' traces, and the anchor kernels
# (FlashInfer's, built by scripts/build-anchors.sh and committed under ptx/anchors/).
model_args=("$work/ptxas.txt" "$work/loops.txt" ptx/anchors/flashinfer)
if [ "${PAGEDKV_ENFORCE_MODEL:-0}" = 1 ]; then model_args+=(--enforce); fi
if ! cargo run -q --release --example decode_model -- "${model_args[@]}" > "$work/model.md"; then
  cat "$work/model.md" >&2
  echo "validate-ptx: the speed model misses a bar or an anchor's error bound (see above)" >&2
  bad=1
fi
cat "$work/model.md" >> "$report"
if [ -n "${PAGEDKV_MODEL_KEEP:-}" ]; then
  mkdir -p "$PAGEDKV_MODEL_KEEP"
  cp "$work"/ptxas.txt "$work"/loops.txt "$work"/*.sass "$PAGEDKV_MODEL_KEEP"/
  echo "validate-ptx: the model's inputs are in $PAGEDKV_MODEL_KEEP"
fi

if [ $bad -ne 0 ]; then
  cat "$report"
  exit 1
fi

if [ "$mode" = check ]; then
  if ! cmp -s "$report" ptx/resources.md; then
    diff -u ptx/resources.md "$report" >&2 || true
    echo "validate-ptx --check: ptx/resources.md is stale; run scripts/validate-ptx.sh and commit it" >&2
    exit 1
  fi
  echo "validate-ptx --check: ptx/resources.md is current"
else
  cp "$report" ptx/resources.md
  echo "validate-ptx: wrote ptx/resources.md"
fi
