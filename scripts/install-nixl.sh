#!/usr/bin/env bash
# Installs NIXL's libraries from the nixl-cu12 wheel on PyPI (pinned below) into the
# ignored folder .tools/, and prints the environment a process needs to use them:
#
#   eval "$(scripts/install-nixl.sh)"
#
# pagedkv-dist's `nixl` feature builds nixl-sys with its `stub-api` feature (no NIXL
# headers needed: the wheel ships none), which opens libnixl_capi.so at run time; the
# wheel ships it with libnixl, its UCX plugin and UCX itself. No CUDA is needed for
# host memory. The printed variables: LD_LIBRARY_PATH (the wheel's library folders),
# NIXL_PLUGIN_DIR (its plugins), and UCX_TLS=tcp,self (UCX over TCP, loopback on one
# machine, as between two hosts).
set -euo pipefail
cd "$(dirname "$0")/.."

NIXL_WHEEL_VERSION=1.5.1
DIR=.tools/nixl-$NIXL_WHEEL_VERSION
LIBS=$DIR/.nixl_cu12.mesonpy.libs
if [[ ! -f $LIBS/libnixl_capi.so ]]; then
  mkdir -p .tools/dl "$DIR"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 \
    -d .tools/dl "nixl-cu12==$NIXL_WHEEL_VERSION" >&2
  unzip -q -o .tools/dl/nixl_cu12-"$NIXL_WHEEL_VERSION"-*.whl \
    '.nixl_cu12.mesonpy.libs/*' 'nixl_cu12.libs/*' -d "$DIR" >&2
fi
[[ -f $LIBS/libnixl_capi.so && -f $LIBS/plugins/libplugin_UCX.so ]] || {
  echo "install-nixl: the nixl-cu12 $NIXL_WHEEL_VERSION wheel holds no libnixl_capi.so or UCX plugin" >&2
  exit 1
}
ABS=$(cd "$DIR" && pwd)
echo "export LD_LIBRARY_PATH=$ABS/.nixl_cu12.mesonpy.libs:$ABS/nixl_cu12.libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export NIXL_PLUGIN_DIR=$ABS/.nixl_cu12.mesonpy.libs/plugins"
echo "export UCX_TLS=tcp,self"
