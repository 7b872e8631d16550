#!/usr/bin/env bash
# The C test programs (capi/examples/minimal.c, capi/tests/c/driver.c and
# capi/tests/c/hostile.c: threads destroying a scheduler while others call it, wrong
# counts, a panic inside a call, an overflowing layout) under AddressSanitizer and
# UndefinedBehaviorSanitizer.
#
#   scripts/sanitize-c.sh            build and run all three; fails on any report
#
# The C side is compiled with `$CC -fsanitize=address,undefined` (CC defaults to cc).
# The Rust side (libpagedkv_c.a, with the test-only `testing` feature) is instrumented
# too when it can be: `-Zsanitizer=address -Zbuild-std` with the pinned nightly (which
# this script installs with rust-src when missing), so that a use after free or an
# overflow inside the library is reported, not only one in the C code. Set
# PAGEDKV_SANITIZE_RUST=0 to use the uninstrumented stable build instead (faster, but
# then only the C code's memory accesses are checked).
#
# Skips with a message (exit 0) when the C compiler cannot build and run a sanitized
# program even after trying to install the runtimes (apt-get, as root). Output goes to
# target/sanitize-c/.
set -euo pipefail

TOOLCHAIN=nightly-2026-05-19
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CC=${CC:-cc}
OUT=target/sanitize-c
mkdir -p "$OUT"
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

say() { echo "sanitize-c: $*" >&2; }

# 1. Can the C compiler build and run a sanitized program?
probe() {
  printf '#include <stdlib.h>\nint main(void){char*p=malloc(4);p[0]=1;int r=p[0]-1;free(p);return r;}\n' \
    >"$OUT/probe.c"
  "$CC" "${SAN[@]}" "$OUT/probe.c" -o "$OUT/probe" >"$OUT/probe.log" 2>&1 && "$OUT/probe" >>"$OUT/probe.log" 2>&1
}
if ! probe; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing the sanitizer runtimes (libasan, libubsan)"
    (apt-get update -qq && apt-get install -y -qq gcc libasan8 libubsan1) >/dev/null 2>&1 ||
      (apt-get install -y -qq gcc libasan6 libubsan1) >/dev/null 2>&1 || true
  fi
  if ! probe; then
    say "SKIP: $CC cannot build and run a program with -fsanitize=address,undefined:"
    sed 's/^/  /' "$OUT/probe.log" >&2
    exit 0
  fi
fi

# 2. libpagedkv_c.a, instrumented with ASan when the pinned nightly can build it.
host=$(rustc -vV | sed -n 's/^host: //p')
lib=
if [ "${PAGEDKV_SANITIZE_RUST:-1}" != 0 ]; then
  if ! rustup run "$TOOLCHAIN" rustc --version >/dev/null 2>&1; then
    say "installing $TOOLCHAIN (rust-src, for -Zbuild-std)"
    rustup toolchain install "$TOOLCHAIN" --profile minimal --component rust-src >/dev/null 2>&1 || true
  fi
  rustup component add rust-src --toolchain "$TOOLCHAIN" >/dev/null 2>&1 || true
  say "building libpagedkv_c.a with -Zsanitizer=address ($TOOLCHAIN, -Zbuild-std)"
  if RUSTFLAGS="-Zsanitizer=address" cargo "+$TOOLCHAIN" build -Zbuild-std --target "$host" \
      -p pagedkv-capi --lib --features testing --target-dir target/asan >"$OUT/rust-asan.log" 2>&1; then
    lib=target/asan/$host/debug/libpagedkv_c.a
    say "Rust side instrumented: $lib"
  else
    say "the instrumented build failed (tail of $OUT/rust-asan.log below); using the uninstrumented library"
    tail -n 20 "$OUT/rust-asan.log" >&2
  fi
fi
if [ -z "$lib" ]; then
  cargo build -p pagedkv-capi --lib --features testing --target-dir target/capi-testing >"$OUT/rust.log" 2>&1 ||
    { tail -n 40 "$OUT/rust.log" >&2; exit 1; }
  lib=target/capi-testing/debug/libpagedkv_c.a
  say "Rust side NOT instrumented (only the C code's accesses are checked): $lib"
fi

# 3. Each program, sanitized, run; any sanitizer report fails it (non-zero exit).
fail=0
run() {
  local name=$1 src=$2 expect=$3
  local exe=$OUT/$name
  "$CC" -std=c11 -Wall -Werror "${SAN[@]}" -pthread -I capi/include "$src" "$lib" \
    -lpthread -ldl -lm -o "$exe"
  local rc=0
  "$exe" >"$exe.out" 2>"$exe.err" || rc=$?
  if [ "$rc" != 0 ] || ! tail -n 1 "$exe.out" | grep -qx "$expect"; then
    say "FAIL $name (exit $rc); stdout tail and stderr:"
    tail -n 5 "$exe.out" >&2
    head -n 80 "$exe.err" >&2
    fail=1
  elif [ "$name" = hostile ] && [ -s "$exe.err" ]; then
    say "FAIL $name: the library wrote to stderr:"
    head -n 40 "$exe.err" >&2
    fail=1
  else
    say "ok $name"
  fi
}
run minimal capi/examples/minimal.c "finished after 3 steps"
run driver capi/tests/c/driver.c ok
run hostile capi/tests/c/hostile.c ok
if [ "$fail" != 0 ]; then
  exit 1
fi
say "all C programs clean under ASan+UBSan"
