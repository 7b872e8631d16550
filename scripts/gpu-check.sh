#!/usr/bin/env bash
# GPU check: the ignored GPU tests and a short benchmark table, as one command for a
# machine with an NVIDIA GPU and no Rust toolchain or network.
#
#   scripts/gpu-check.sh --bundle   (here, with cargo) build the release test and bench
#                                   binaries with the PTX embedded, strip them, and copy
#                                   them into the ignored folder .gpu-bundle/
#   scripts/gpu-check.sh            (on the GPU machine) run them and write a markdown
#                                   report to $REPORT (default: $OUT/gpu-report.md if
#                                   $OUT is set, else gpu-report.md)
#
# The report: GPU name, driver, device-to-device copy bandwidth, and per shape the
# median time, GB/s (from the documented byte count) and % of the copy bandwidth; then
# the GPU tests' results. Budget: under 8 minutes (each step has a timeout).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUNDLE=.gpu-bundle

if [ "${1:-}" = "--bundle" ]; then
  set -e
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
  for spec in "test --release --test cuda_backend" "bench --bench kernels"; do
    # shellcheck disable=SC2086
    cargo $spec --no-run --message-format=json 2>/dev/null \
      | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]!=["lib"]:
        print(m["target"]["name"], m["executable"])' \
      | while read -r name exe; do cp "$exe" "$BUNDLE/$name"; strip "$BUNDLE/$name" || true; done
  done
  ls -la "$BUNDLE"
  du -sh "$BUNDLE"
  exit 0
fi

REPORT=${REPORT:-${OUT:+$OUT/}gpu-report.md}
LOG=${OUT:-.}/gpu-check.log
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }

[ -x "$BUNDLE/cuda_backend" ] && [ -x "$BUNDLE/kernels" ] || {
  echo "gpu-check: no binaries in $BUNDLE: run scripts/gpu-check.sh --bundle on a machine with cargo first" >&2
  exit 2
}

say "== glibc and binaries =="
ldd --version 2>&1 | head -1 | tee -a "$LOG"
if ! "$BUNDLE/cuda_backend" --list >> "$LOG" 2>&1; then
  say "gpu-check: the test binary does not run here (glibc too old?); see $LOG"
  exit 3
fi

say "== GPU =="
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
say "${GPU:-nvidia-smi unavailable}"

say "== GPU tests (ignored by default) =="
timeout 300 "$BUNDLE/cuda_backend" --ignored --test-threads 1 2>&1 | tee -a "$LOG" | tail -15
TEST_RC=${PIPESTATUS[0]}

say "== benchmarks =="
BENCH_MD=$(mktemp)
PAGEDKV_BENCH_REPORT=$BENCH_MD timeout 360 "$BUNDLE/kernels" --bench --warm-up-time 0.2 --measurement-time 0.5 --noplot 2>&1 \
  | tee -a "$LOG" | grep -E "copy:|skipped|^\|" | tail -60
BENCH_RC=${PIPESTATUS[0]}

{
  echo "# pagedkv GPU check, $(date -u +%Y-%m-%d)"
  echo
  echo "- GPU: ${GPU:-unknown} (name, driver, memory from nvidia-smi)"
  echo "- glibc here: $(ldd --version 2>&1 | head -1)"
  echo "- GPU tests: exit status $TEST_RC; benchmarks: exit status $BENCH_RC"
  echo
  echo "## Benchmarks"
  echo
  cat "$BENCH_MD" 2>/dev/null || echo "(no benchmark table)"
  echo
  echo "## GPU tests"
  echo
  echo '```'
  grep -E "^test |test result" "$LOG" | grep -v -- "--list" | tail -20
  echo '```'
} > "$REPORT"
say "gpu-check: wrote $REPORT"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
