#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ (cargo-fuzz, libFuzzer, AddressSanitizer) for a
# while each.
#
#   scripts/fuzz.sh            every target, 20 seconds each
#   scripts/fuzz.sh 300        every target, 300 seconds each
#
# Installs what it needs when missing: the pinned nightly (cargo-fuzz needs
# -Zsanitizer) and cargo-fuzz (`cargo install cargo-fuzz --locked`). The targets are
# the [[bin]] entries of fuzz/Cargo.toml, as `cargo fuzz list` reports them. Corpora
# grow in fuzz/corpus/<target>/, crashes land in fuzz/artifacts/<target>/ (both
# ignored by git); a crash fails the script, with the command that reproduces it.
set -euo pipefail

TOOLCHAIN=nightly-2026-05-19
SECONDS_EACH=${1:-20}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

case "$SECONDS_EACH" in
  '' | *[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac

say() { echo "fuzz: $*" >&2; }

if ! rustup run "$TOOLCHAIN" rustc --version >/dev/null 2>&1; then
  say "installing $TOOLCHAIN"
  rustup toolchain install "$TOOLCHAIN" --profile minimal --component rust-src
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

targets=$(cargo "+$TOOLCHAIN" fuzz list)
if [ -z "$targets" ]; then
  say "no fuzz targets in fuzz/Cargo.toml"
  exit 1
fi

failed=()
for t in $targets; do
  say "building $t"
  cargo "+$TOOLCHAIN" fuzz build "$t"
  mkdir -p "fuzz/corpus/$t"
  say "running $t for ${SECONDS_EACH}s"
  # -rss_limit_mb: a target allocating without bound is a finding too.
  if ! cargo "+$TOOLCHAIN" fuzz run "$t" "fuzz/corpus/$t" -- \
      -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1; then
    failed+=("$t")
    say "$t FAILED; reproduce with: cargo +$TOOLCHAIN fuzz run $t fuzz/artifacts/$t/<crash-file>"
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  say "failed: ${failed[*]}"
  exit 1
fi
say "every target ran ${SECONDS_EACH}s without a crash: $(echo $targets)"
