#!/usr/bin/env bash
# Assemble every committed PTX file with ptxas for its architecture, write the resource
# report ptx/resources.md, and fail if any kernel has a stack frame or spills.
#
#   scripts/validate-ptx.sh           validate and rewrite ptx/resources.md
#   scripts/validate-ptx.sh --check   validate and fail if ptx/resources.md is stale
#
# ptxas comes from PyPI (nvidia-cuda-nvcc-cu12, pinned below), unpacked into the
# ignored folder .tools/: no CUDA toolkit is needed.
set -euo pipefail

NVCC_WHEEL_VERSION=12.9.86
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

report=$(mktemp)
log=$(mktemp)
trap 'rm -f "$report" "$log"' EXIT

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
  if ! "$PTXAS" -arch="$arch" -v -o /dev/null "$f" 2> "$log"; then
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
                              printf "| %s | %s | %s | %s | %s | %s | %s |\n", arch, name, regs, smem, stack, spst, spld }
  ' "$log")
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
done

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
