#!/usr/bin/env bash
# GPU check: the ignored GPU tests, compute-sanitizer on small cases and the kernel
# benchmark, as one command for a machine with an NVIDIA GPU and no Rust toolchain or
# network.
#
#   scripts/gpu-check.sh --bundle   (here, with cargo and PyPI) build the release test and
#                                   bench binaries for glibc 2.17 with cargo-zigbuild,
#                                   strip them, check that no binary needs a GLIBC symbol
#                                   newer than 2.17, add compute-sanitizer, and write all of
#                                   it with a MANIFEST into the ignored .gpu-bundle/ (at
#                                   most 60 MiB: the runner carries 64 MiB)
#   scripts/gpu-check.sh            (on the GPU machine) run the bundle and append a
#                                   markdown report row by row to $REPORT (default
#                                   $OUT/gpu-report.md if $OUT is set, else gpu-report.md),
#                                   so a run cut short still leaves every row measured
#                                   so far; full output in gpu-check.log and one log per
#                                   run in gpu-check-logs/ (beside the report)
#
# Time budget: the whole check ends within 8 minutes (480 s); every run is under
# `timeout`, cut to what is left of its step's budget and of the whole, and a run that
# no longer fits is reported as not run:
#   header (nvidia-smi, glibc, sanitizer version, --list)   <=  30 s
#   GPU tests, one process each, <= 120 s per test          <= 170 s in all
#   compute-sanitizer memcheck, racecheck, synccheck on the
#     sanitizer_small_* tests, <= 40 s per run              <= 100 s in all
#   kernels bench (criterion + its summary table, then the speed
#     model's rows modelled next to measured)            the rest, >= 170 s
#   slack before the 480 s mark                                 10 s
#
# Exit status: 0 when every test passed and every sanitizer run was clean, or when there
# is no GPU (nvidia-smi lists none and there is no /dev/nvidiactl): the report then says
# "GPU absent" on every GPU row (set GPU_CHECK_REQUIRE_GPU=1 to make that exit 4);
# 1 when a GPU test failed, timed out or did not fit in the budget, a sanitizer run found
# errors, failed, timed out or did not fit, or the bench failed (a bench cut by its
# timeout is reported, not a failure: its rows so far are in the report);
# 2 when the bundle is missing or incomplete; 3 when the binaries do not run here.
# --bundle exits 0, or non-zero when a build, the GLIBC check or the size limit fails.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

BUNDLE=.gpu-bundle
MANIFEST=$BUNDLE/MANIFEST.txt
SANITIZER_DIR=$BUNDLE/compute-sanitizer

# ---- bundle settings ----
TOOLS=.tools
ZIG_TARGET=x86_64-unknown-linux-gnu.2.17
GLIBC_MAX=2.17
BUNDLE_MAX_MIB=60
# Pinned so a bundle is reproducible: the versions this script was checked with.
ZIG_PIP=(ziglang==0.17.1 cargo-zigbuild==0.24.1)
# The 12.9 wheel ships the compute-sanitizer executable (bin/) beside its injection
# libraries (lib/); 12.8.93's has the libraries only. It needs GLIBC 2.25 (its wheel is
# manylinux_2_25), which the GPU machine's report header shows against ldd --version.
SANITIZER_PIP=nvidia-cuda-sanitizer-api-cu12==12.9.79

# ---- check settings (seconds) ----
TOTAL_S=480
SLACK_S=10
TESTS_S=170
TEST_RUN_S=120
SANITIZER_S=100
SANITIZER_RUN_S=40
MIN_RUN_S=5
SANITIZER_TOOLS=(memcheck racecheck synccheck)

die() { echo "gpu-check: $*" >&2; exit 1; }

# ============================================================================
# --bundle: build here
# ============================================================================

# Installs ziglang and cargo-zigbuild from PyPI into .tools/zig (once) and puts the zig
# executable and cargo-zigbuild on PATH.
install_zigbuild() {
  local dir=$TOOLS/zig
  if [ ! -x "$dir/bin/cargo-zigbuild" ] || [ ! -x "$dir/ziglang/zig" ]; then
    echo "== installing ${ZIG_PIP[*]} into $dir =="
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --upgrade \
      --target "$dir" "${ZIG_PIP[@]}" || die "pip install ${ZIG_PIP[*]} failed"
  fi
  export PATH="$ROOT/$dir/ziglang:$ROOT/$dir/bin:$PATH"
  export PYTHONPATH="$ROOT/$dir${PYTHONPATH:+:$PYTHONPATH}"
}

# Installs the compute-sanitizer wheel into .tools/sanitizer (once) and copies the
# executable and its libraries into one folder of the bundle: the executable looks for
# its injection libraries beside itself, as in the CUDA toolkit's compute-sanitizer/
# folder (run from the wheel's bin/ it says "Unable to find injection library").
bundle_sanitizer() {
  local dir=$TOOLS/sanitizer
  local src=$dir/nvidia/cuda_sanitizer_api
  if [ ! -f "$src/bin/compute-sanitizer" ]; then
    echo "== installing $SANITIZER_PIP into $dir =="
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
      --target "$dir" "$SANITIZER_PIP" || die "pip install $SANITIZER_PIP failed"
  fi
  mkdir -p "$SANITIZER_DIR"
  # The executable and the six libraries it loads (libsanitizer-collection.so loads
  # libsanitizer-public.so by name); not the headers.
  cp "$src/bin/compute-sanitizer" "$src"/lib/*.so "$SANITIZER_DIR/" || die "copying compute-sanitizer"
  chmod +x "$SANITIZER_DIR/compute-sanitizer"
}

# Builds the cuda_backend test and the kernels bench for $ZIG_TARGET in one cargo run
# (release profile) and copies the executables, stripped, into the bundle.
build_binaries() {
  local json
  json=$(mktemp)
  echo "== cargo zigbuild --release --target $ZIG_TARGET --test cuda_backend --bench kernels =="
  cargo zigbuild --release --target "$ZIG_TARGET" --test cuda_backend --bench kernels \
    --message-format=json-render-diagnostics > "$json" || die "cargo zigbuild failed"
  python3 - "$json" "$BUNDLE" <<'EOF' || die "copying the binaries failed"
import json, shutil, sys
src, dest = sys.argv[1], sys.argv[2]
found = set()
for line in open(src):
    m = json.loads(line)
    name = m.get("target", {}).get("name")
    if m.get("reason") == "compiler-artifact" and m.get("executable") and name in ("cuda_backend", "kernels"):
        shutil.copy2(m["executable"], f"{dest}/{name}")
        found.add(name)
missing = {"cuda_backend", "kernels"} - found
if missing:
    sys.exit(f"no executable for {sorted(missing)}")
EOF
  rm -f "$json"
  strip "$BUNDLE/cuda_backend" "$BUNDLE/kernels" || die "strip failed"
}

# Newest GLIBC_x.y symbol version an ELF file needs ("none" if none).
newest_glibc() {
  objdump -T "$1" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' \
    | sort -uV | tail -1 | grep . || echo none
}

# Whether version $1 <= version $2.
version_le() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }

# Checks the GLIBC versions our binaries need and writes the manifest.
write_manifest() {
  local newest=0 v f bad=0 libs
  {
    echo "built:            $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m)"
    echo "commit:           $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "rustc:            $(rustc --version)"
    echo "zig:              $(zig version), $(cargo-zigbuild --version)"
    echo "target:           $ZIG_TARGET"
    echo "compute-sanitizer: $SANITIZER_PIP ($("$SANITIZER_DIR/compute-sanitizer" --version 2>&1 | grep -i '^version' | head -1))"
    echo
    echo "file                                                 bytes      newest GLIBC  needs"
    for f in "$BUNDLE/cuda_backend" "$BUNDLE/kernels" "$SANITIZER_DIR"/*; do
      v=$(newest_glibc "$f")
      libs=$(objdump -p "$f" 2>/dev/null | awk '/NEEDED/ {print $2}' | tr '\n' ' ')
      printf '%-52s %-10s %-13s %s\n' "${f#"$BUNDLE"/}" "$(stat -c %s "$f")" "$v" "$libs"
      case $f in
        "$SANITIZER_DIR"/*) ;;  # NVIDIA's binaries: recorded, not held to 2.17
        *)
          [ "$v" = none ] && continue
          version_le "$v" "$newest" || newest=$v
          version_le "$v" "$GLIBC_MAX" || bad=1
          ;;
      esac
    done
    echo
    echo "newest GLIBC symbol in the test and bench binaries: GLIBC_$newest (limit GLIBC_$GLIBC_MAX)"
    echo "compute-sanitizer needs GLIBC_$(newest_glibc "$SANITIZER_DIR/compute-sanitizer")"
    echo "size of the files above: $(du -sb "$BUNDLE" | cut -f1) bytes (bundle limit $BUNDLE_MAX_MIB MiB)"
  } > "$MANIFEST"
  cat "$MANIFEST"
  [ "$bad" -eq 0 ] || die "a bundled binary needs a GLIBC symbol newer than $GLIBC_MAX (see above)"
}

bundle() {
  command -v cargo >/dev/null || die "--bundle needs cargo"
  command -v objdump >/dev/null || die "--bundle needs objdump (binutils)"
  install_zigbuild
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE" || die "cannot create $BUNDLE"
  build_binaries
  bundle_sanitizer
  write_manifest
  local bytes
  bytes=$(du -sb "$BUNDLE" | cut -f1)
  ls -la "$BUNDLE" "$SANITIZER_DIR"
  echo "gpu-check: bundle $BUNDLE is $((bytes / 1024 / 1024)) MiB ($bytes bytes; limit $BUNDLE_MAX_MIB MiB)"
  [ "$bytes" -le $((BUNDLE_MAX_MIB * 1024 * 1024)) ] \
    || die "the bundle is larger than $BUNDLE_MAX_MIB MiB: the runner carries 64 MiB at most"
}

if [ "${1:-}" = "--bundle" ]; then
  bundle
  exit 0
fi

# ============================================================================
# the check: run on the GPU machine
# ============================================================================

OUT_DIR=${OUT:-.}
REPORT=${REPORT:-$OUT_DIR/gpu-report.md}
LOG=$OUT_DIR/gpu-check.log
LOGS=$OUT_DIR/gpu-check-logs
BIN=$BUNDLE/cuda_backend
BENCH=$BUNDLE/kernels
SANITIZER=$SANITIZER_DIR/compute-sanitizer
END_S=$((TOTAL_S - SLACK_S))  # every run ends before this many seconds of $SECONDS
FAILED=0
GPU=0

# Appends a line to the report (and to the terminal and the log) at once.
row() { printf '%s\n' "$*" | tee -a "$LOG" >> "$REPORT"; printf '%s\n' "$*"; }

# Appends an excerpt of a log to the report as an indented code block: the last lines
# of a test's panic message (what libtest prints between "---- NAME stdout ----" and
# "failures:"), or the log's last lines if there is none.
row_tail() {
  local file=$1 lines=${2:-20} excerpt
  excerpt=$(awk '/^---- .* stdout ----$/ {on = 1; next} /^failures:$/ {on = 0} on && NF' "$file" | tail -n "$lines")
  [ -n "$excerpt" ] || excerpt=$(tail -n "$lines" "$file")
  { echo '  ```'; printf '%s\n' "$excerpt" | sed 's/^/  /'; echo '  ```'; } >> "$REPORT"
}

# Appends compute-sanitizer's first findings (its "=========" lines) to the report.
row_sanitizer_findings() {
  local file=$1
  { echo '  ```'; grep '^=========' "$file" | head -n 40 | sed 's/^/  /'; echo '  ```'; } >> "$REPORT"
}

# Seconds a run may take: its own limit, cut to what is left of its step and of the
# whole check; prints 0 when less than MIN_RUN_S is left.
run_limit() {
  local own=$1 step_end=$2 left
  left=$(( (step_end < END_S ? step_end : END_S) - SECONDS ))
  [ "$left" -lt "$own" ] && own=$left
  [ "$own" -lt "$MIN_RUN_S" ] && own=0
  echo "$own"
}

# Runs a command under timeout with its output in a log file; sets RC and ELAPSED.
timed_run() {
  local limit=$1 log=$2 t0=$SECONDS
  shift 2
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  RC=$?
  ELAPSED=$((SECONDS - t0))
}

# Checks that the bundle is complete.
check_bundle() {
  local f
  for f in "$BIN" "$BENCH" "$SANITIZER" "$MANIFEST"; do
    [ -e "$f" ] || {
      echo "gpu-check: $f missing: run scripts/gpu-check.sh --bundle on a machine with cargo first" >&2
      exit 2
    }
  done
}

# The report's header: the machine, the GPU (or its absence), the bundle manifest.
header() {
  local gpu driver clocks glibc
  gpu=$(timeout 10 nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv,noheader 2>/dev/null | head -1)
  driver=$(timeout 10 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  clocks=$(timeout 10 nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null)
  glibc=$(ldd --version 2>&1 | head -1)
  [ -n "$glibc" ] || glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null)
  if [ -n "$gpu" ] || [ -e /dev/nvidiactl ]; then GPU=1; fi
  row "# pagedkv GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  row ""
  row "- GPU: ${gpu:-no GPU (nvidia-smi unavailable)}"
  if [ -z "$gpu" ] && [ "$GPU" -eq 1 ]; then
    row "  (nvidia-smi lists nothing, but /dev/nvidiactl exists: the GPU steps run)"
  fi
  row "- driver: ${driver:-unknown}"
  if [ -n "$clocks" ]; then
    row "- clocks (nvidia-smi):"
    { echo '  ```'; printf '%s\n' "$clocks" | sed 's/^/  /'; echo '  ```'; } >> "$REPORT"
  else
    row "- clocks: unknown"
  fi
  row "- glibc here: ${glibc:-unknown}"
  row "- compute-sanitizer: $(timeout 10 "$SANITIZER" --version 2>&1 | grep -i '^version' | head -1)"
  row "- budget: ${TOTAL_S} s in all; exit status: see the header of scripts/gpu-check.sh"
  row ""
  row "Bundle manifest:"
  row ""
  { echo '```'; cat "$MANIFEST"; echo '```'; } >> "$REPORT"
  row ""
}

# Checks that the test binary runs on this machine's glibc.
check_binary_runs() {
  if ! timeout 15 "$BIN" --list > "$LOGS/list.log" 2>&1; then
    row "**The test binary does not run here** (glibc too old?):"
    row_tail "$LOGS/list.log"
    exit 3
  fi
}

# Names of the test binary's tests: all (`--list`) or the ignored ones (`--ignored`).
list_tests() {
  timeout 15 "$BIN" --list "$@" 2>/dev/null | sed -n 's/: test$//p'
}

# One test in its own process; appends its row (and its failure's tail).
run_test() {
  local name=$1 ignored=$2 step_end=$3 limit log
  log=$LOGS/test-$name.log
  if [ "$ignored" = yes ] && [ "$GPU" -eq 0 ]; then
    row "- \`$name\`: GPU absent, not run"
    return
  fi
  limit=$(run_limit "$TEST_RUN_S" "$step_end")
  if [ "$limit" -eq 0 ]; then
    FAILED=1
    row "- \`$name\`: not run: the step's time budget is spent"
    return
  fi
  local args=(--exact "$name" --test-threads 1)
  [ "$ignored" = yes ] && args+=(--ignored)
  timed_run "$limit" "$log" "$BIN" "${args[@]}"
  # `--exact` with a wrong name runs nothing and exits 0: a pass must show the test.
  if [ "$RC" -eq 0 ] && grep -q "test result: ok. 1 passed" "$log"; then
    row "- \`$name\`: PASS (${ELAPSED} s)"
  elif [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
    FAILED=1
    row "- \`$name\`: **TIMEOUT** after ${limit} s"
    row_tail "$log"
  else
    FAILED=1
    row "- \`$name\`: **FAIL** (exit $RC, ${ELAPSED} s)"
    row_tail "$log"
  fi
}

gpu_tests() {
  local step_end=$((SECONDS + TESTS_S)) name
  row "## GPU tests (one process each, timeout ${TEST_RUN_S} s, ${TESTS_S} s in all)"
  row ""
  # The tests that run without a GPU too (they check the no-GPU error path here).
  for name in $(comm -23 <(list_tests | sort) <(list_tests --ignored | sort)); do
    run_test "$name" no "$step_end"
  done
  local ignored
  # The small sanitizer_* cases first: quick, and the sanitizer step reruns them.
  ignored=$(list_tests --ignored | grep '^sanitizer_'; list_tests --ignored | grep -v '^sanitizer_')
  [ -n "$ignored" ] || row "- no ignored tests in the test binary (\`--list --ignored\` is empty)"
  for name in $ignored; do
    run_test "$name" yes "$step_end"
  done
  row ""
}

# One compute-sanitizer run of one small test; appends its row.
run_sanitizer() {
  local tool=$1 name=$2 step_end=$3 limit log summary
  log=$LOGS/$tool-$name.log
  if [ "$GPU" -eq 0 ]; then
    row "- $tool \`$name\`: GPU absent, not run"
    return
  fi
  limit=$(run_limit "$SANITIZER_RUN_S" "$step_end")
  if [ "$limit" -eq 0 ]; then
    FAILED=1
    row "- $tool \`$name\`: not run: the step's time budget is spent"
    return
  fi
  timed_run "$limit" "$log" "$SANITIZER" --tool "$tool" --error-exitcode 86 \
    "$BIN" --exact "$name" --ignored --test-threads 1
  summary=$(grep -E "(ERROR|RACECHECK|SYNCCHECK) SUMMARY" "$log" | sed 's/^=* *//' | paste -sd ';' -)
  if [ "$RC" -eq 0 ] && grep -q "test result: ok. 1 passed" "$log"; then
    row "- $tool \`$name\`: clean (${summary:-no summary}, ${ELAPSED} s)"
  elif [ "$RC" -eq 0 ]; then
    # An old compute-sanitizer can print a clean summary without running the target.
    FAILED=1
    row "- $tool \`$name\`: **FAIL**: exit 0 but the test did not run (${summary:-no summary})"
    row_tail "$log"
  elif [ "$RC" -eq 86 ]; then
    FAILED=1
    row "- $tool \`$name\`: **ERRORS** (${summary:-no summary}, ${ELAPSED} s)"
    row_sanitizer_findings "$log"
  elif [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
    FAILED=1
    row "- $tool \`$name\`: **TIMEOUT** after ${limit} s"
    row_tail "$log"
  else
    FAILED=1
    row "- $tool \`$name\`: **FAIL** (exit $RC, ${ELAPSED} s; the test failed or the tool did not start)"
    row_tail "$log"
  fi
}

sanitizer_checks() {
  local step_end=$((SECONDS + SANITIZER_S)) tool name small
  row "## compute-sanitizer (timeout ${SANITIZER_RUN_S} s per run, ${SANITIZER_S} s in all)"
  row ""
  small=$(list_tests --ignored | grep '^sanitizer_')
  [ -n "$small" ] || row "- no \`sanitizer_*\` tests in the test binary"
  # Tool by tool, so memcheck covers every kernel first if the budget runs out.
  for tool in "${SANITIZER_TOOLS[@]}"; do
    for name in $small; do
      run_sanitizer "$tool" "$name" "$step_end"
    done
  done
  row ""
}

# The kernels bench, its output appended to the report as it comes.
bench() {
  local limit rc table=$LOGS/bench-table.md
  limit=$(run_limit "$TOTAL_S" "$END_S")
  row "## Benchmarks (\`kernels\`, timeout ${limit} s)"
  row ""
  if [ "$GPU" -eq 0 ]; then
    row "GPU absent: the bench runs its CPU reference benchmark only."
    row ""
  fi
  if [ "$limit" -eq 0 ]; then
    row "not run: the time budget is spent"
    return
  fi
  echo '```' >> "$REPORT"
  # --discard-baseline: compare with nothing a previous run left in target/criterion.
  PAGEDKV_BENCH_REPORT=$table timeout -k 10 "$limit" "$BENCH" --bench \
    --warm-up-time 0.2 --measurement-time 0.5 --noplot --discard-baseline 2>&1 \
    | tee -a "$LOG" >> "$REPORT"
  rc=${PIPESTATUS[0]}
  echo '```' >> "$REPORT"
  row ""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    row "bench: **cut by its ${limit} s timeout** (the summary table is written at the end)"
  elif [ "$rc" -ne 0 ]; then
    FAILED=1
    row "bench: **FAIL** (exit $rc)"
  fi
  if [ -s "$table" ]; then
    row "Summary table:"
    row ""
    cat "$table" >> "$REPORT"
    row ""
    model_vs_measured "$table" >> "$REPORT"
  fi
}

# The speed model's rows (ptx/resources.md, a model from the SASS) next to the bench's
# measurement of the same shape on this GPU, so the first GPU run tells how far the model
# was off: decode as % of peak DRAM bandwidth, prefill as TFLOP/s.
#   model_vs_measured BENCH_TABLE [GPU_NAME]
model_vs_measured() {
  local table=$1 name=${2:-} gpu
  [ -n "$name" ] || name=$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "${name^^}" in
    *H200*) gpu="H200" ;;
    *H100*PCIE*) gpu="" ;;
    *H100*) gpu="H100 SXM" ;;
    *A100-SXM4-80GB*|*A100*80GB*SXM*) gpu="A100 80GB SXM" ;;
    *) gpu="" ;;
  esac
  echo "## Modelled next to measured"
  echo
  if [ -z "$gpu" ]; then
    echo "The model has no rows for this GPU (${name:-unknown})."
    echo
    return
  fi
  echo "Model: ptx/resources.md (from the SASS, no GPU); measured: the summary table above (CUDA events, kernels launched back to back on a stream, not in a graph), on ${name}."
  echo
  echo "| row | modelled | measured | measured / modelled |"
  echo "|---|---|---|---|"
  awk -F'|' -v gpu="$gpu" '
    function trim(s) { gsub(/^ +| +$/, "", s); return s }
    FNR == NR {
      # The model: decode rows "| batch B, ctx C | cache | GPU | ... | % of peak |" and
      # prefill rows "| (a) S x N new | q | GPU | ... | TFLOP/s | ceiling | % |".
      if (trim($4) != gpu) next
      shape = trim($2); cache = trim($3)
      if (shape ~ /^batch [0-9]+, ctx [0-9]+$/) {
        split(shape, w, /[ ,]+/)
        types = (cache == "e4m3") ? "f16-e4m3" : cache
        key = "decode " types "/q32kv8/b" w[2] "/ctx" w[4]
        model[key] = trim($(NF - 1)); label[key] = shape ", " cache; order[++n] = key
      } else if (shape ~ /^\([a-z]\) [0-9]+ x [0-9]+ /) {
        split(shape, w, / +/)
        cached = (shape ~ /after/) ? w[7] : 0
        key = "prefill " w[2] " x " w[4] " x " cached " " cache
        model[key] = trim($10) " TFLOP/s"; label[key] = "prefill " shape ", " cache; order[++n] = key
      }
      next
    }
    {
      r = trim($2)
      if (r ~ /^decode /) { sub(/ \(parts.*$/, "", r); measured[r] = trim($7) }
      else if (r ~ /^[0-9]+ x [0-9]+ x [0-9]+$/) { measured["prefill " r " " trim($3)] = trim($6) " TFLOP/s" }
    }
    END {
      for (i = 1; i <= n; i++) {
        k = order[i]; m = model[k]; v = (k in measured) ? measured[k] : "not measured"
        mv = m; vv = v; gsub(/[^0-9.]/, "", mv); gsub(/[^0-9.]/, "", vv)
        ratio = (vv != "" && mv + 0 > 0) ? sprintf("%.2f", vv / mv) : "-"
        printf "| %s | %s | %s | %s |\n", label[k], m, v, ratio
      }
    }' ptx/resources.md "$table"
  echo
}

main() {
  mkdir -p "$OUT_DIR" "$LOGS"
  : > "$REPORT"
  : > "$LOG"
  check_bundle
  header
  check_binary_runs
  gpu_tests
  sanitizer_checks
  bench
  if [ "$GPU" -eq 0 ]; then
    row "Result: GPU absent: nothing ran on a GPU (exit 0, or 4 with GPU_CHECK_REQUIRE_GPU=1); ${SECONDS} s."
    [ "${GPU_CHECK_REQUIRE_GPU:-0}" = 1 ] && exit 4
    exit 0
  fi
  if [ "$FAILED" -eq 0 ]; then
    row "Result: every GPU test passed and every sanitizer run was clean; ${SECONDS} s."
  else
    row "Result: **FAILURES** above; ${SECONDS} s."
  fi
  echo "gpu-check: wrote $REPORT"
  exit "$FAILED"
}

main
