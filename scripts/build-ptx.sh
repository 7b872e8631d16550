#!/usr/bin/env bash
# Build pagedkv's kernels (kernels-rs) to PTX for every supported architecture.
#
#   scripts/build-ptx.sh           regenerate ptx/*.ptx and ptx/manifest.toml
#   scripts/build-ptx.sh --check   rebuild into a temporary folder and fail if the
#                                  committed PTX or manifest differ from what the
#                                  current sources produce
#
# Installs the pinned nightly (with rust-src, for -Zbuild-std=core) through rustup if it
# is missing: a rust-toolchain.toml alone installs nothing here. Uses rustc's own NVPTX
# backend: `cargo rustc --crate-type cdylib --emit=asm` with the `ptx` profile (fat LTO,
# one codegen unit, panic=abort), see docs/kernels.md, "Toolchain".
set -euo pipefail

TOOLCHAIN=nightly-2026-05-19
ARCHS=(sm_80 sm_90)
# Threads per block of each kernel (by entry-point prefix, or `prefix*suffix`),
# written as `.maxntid`.
MAXNTID="copy_blocks=128 kv_append=128 paged_decode_attention=128 paged_decode_reduce=64 merge_states=64 paged_prefill_attention=32 paged_prefill_attention_f32=128 paged_prefill_attention*_d64=128 paged_prefill_attention*_d128=128"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

mode=write
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

if ! rustup run "$TOOLCHAIN" rustc --version >/dev/null 2>&1; then
  echo "build-ptx: installing $TOOLCHAIN" >&2
  rustup toolchain install "$TOOLCHAIN" --profile minimal --component rust-src
fi
# An earlier install may lack rust-src; this is a no-op when it is there.
rustup component add rust-src --toolchain "$TOOLCHAIN" >/dev/null 2>&1

if [ "$mode" = write ]; then
  out=ptx
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"

# The kernel sources and this script (it holds the flags). The `ptx` profile in the
# workspace Cargo.toml is an input too, but that file changes for unrelated reasons:
# a profile change shows up in --check as a difference in the PTX itself.
sources_sha256() {
  { find kernels-rs -type f \( -name '*.rs' -o -name Cargo.toml \) -not -path '*/target/*'
    echo scripts/build-ptx.sh
  } | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
}

for arch in "${ARCHS[@]}"; do
  tdir="target/ptx-build/$arch"
  asm="$tdir/nvptx64-nvidia-cuda/ptx/deps/pagedkv_kernels.s"
  rm -f "$asm"
  echo "build-ptx: compiling kernels-rs for $arch" >&2
  cargo "+$TOOLCHAIN" rustc -p pagedkv-kernels --lib --crate-type cdylib \
    --profile ptx --target nvptx64-nvidia-cuda -Zbuild-std=core \
    --target-dir "$tdir" --quiet \
    -- --emit=asm -C "target-cpu=$arch" -C linker=/bin/true
  # rustc has no attribute for `.maxntid`: add it to every entry point here, the most
  # threads a block of that kernel has (the host's launch configurations: checked by
  # tests/ops/ptx.rs), so ptxas and the driver enforce the block size the host
  # launches. The longest matching key wins (a `prefix*suffix` key matches names with
  # both, its length theirs together); an entry with none fails the build.
  awk -v table="$MAXNTID" '
    BEGIN { n = split(table, t, " ") }
    /^\.visible \.entry / { name = $3; sub(/\(.*/, "", name); pending = 1 }
    { print }
    pending && /^\)$/ {
      best = ""; bl = 0
      for (i = 1; i <= n; i++) {
        split(t[i], kv, "=")
        pre = kv[1]; suf = ""
        if (index(pre, "*") > 0) { suf = substr(pre, index(pre, "*") + 1); pre = substr(pre, 1, index(pre, "*") - 1) }
        len = length(pre) + length(suf)
        if (index(name, pre) == 1 && (suf == "" || (length(name) >= len && substr(name, length(name) - length(suf) + 1) == suf)) && len > bl) { best = kv[2]; bl = len }
      }
      if (best == "") { print "build-ptx: no .maxntid for " name > "/dev/stderr"; exit 1 }
      print ".maxntid " best ", 1, 1"
      pending = 0
    }' "$asm" > "$out/pagedkv_kernels.$arch.ptx"
done

{
  echo "# Written by scripts/build-ptx.sh: what produced the PTX files beside this one."
  echo "toolchain = \"$TOOLCHAIN\""
  echo "rustc = \"$(rustup run "$TOOLCHAIN" rustc --version)\""
  echo "sources_sha256 = \"$(sources_sha256)\""
  for arch in "${ARCHS[@]}"; do
    f="pagedkv_kernels.$arch.ptx"
    echo
    echo "[[ptx]]"
    echo "arch = \"$arch\""
    echo "file = \"$f\""
    echo "sha256 = \"$(sha256sum "$out/$f" | cut -d' ' -f1)\""
  done
} > "$out/manifest.toml"

if [ "$mode" = check ]; then
  status=0
  for f in manifest.toml "${ARCHS[@]/#/pagedkv_kernels.}"; do
    [ "$f" = manifest.toml ] || f="$f.ptx"
    if ! cmp -s "$out/$f" "ptx/$f"; then
      echo "build-ptx --check: ptx/$f is stale (differs from what the sources produce)" >&2
      diff -u "ptx/$f" "$out/$f" | head -20 >&2 || true
      status=1
    fi
  done
  if [ $status -ne 0 ]; then
    echo "build-ptx --check: FAILED; run scripts/build-ptx.sh and commit ptx/" >&2
    exit 1
  fi
  echo "build-ptx --check: committed PTX matches the sources (${ARCHS[*]})"
else
  echo "build-ptx: wrote ptx/ for ${ARCHS[*]}"
fi
