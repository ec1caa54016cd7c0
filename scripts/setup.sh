#!/usr/bin/env bash
# Installs everything LoongForge needs on a Debian 12 machine: the Debian packages, and a Python virtual
# environment holding the torch wheel (its LibTorch is what we build against) and the test oracles.
# Idempotent and quick when everything is already there. Then configures and builds ./build.
set -euo pipefail
cd "$(dirname "$0")/.."

# Checkouts of one machine share the packages and the environment: one setup at a time installs them.
exec 9>"${TMPDIR:-/tmp}/loongforge-setup.lock"
flock 9

PKGS="build-essential cmake ninja-build ccache pkg-config python3 python3-venv python3-dev
  libopenblas-dev libopenmpi-dev openmpi-bin nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libspdlog-dev
  libfmt-dev libsentencepiece-dev libpcre2-dev libutf8proc-dev libzstd-dev libpng-dev libturbojpeg0-dev
  libhdf5-dev libtiff-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  libavcodec-dev libavformat-dev libavutil-dev libswscale-dev libwebsocketpp-dev libasio-dev libmsgpack-cxx-dev libosmesa6"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q $missing
fi

# Once an environment is made, the older ones of its kind beside it go (environments of older requirement files; the
# main one is a few GB), unless its path was given (GIVEN: the variable's value).
drop_older() {  # VENV PREFIX GIVEN
  [ -z "$3" ] || return 0
  for old in "$(dirname "$1")"/"$2"-*; do
    if [ "$old" != "$1" ]; then rm -rf "$old"; fi
  done
}
# The checkout's link (.venv, .venv-lerobot, ...) to its environment.
link_env() {  # LINK VENV
  if [ "$(readlink -f "$1" 2>/dev/null)" != "$(readlink -f "$2")" ]; then rm -rf "$1"; ln -s "$2" "$1"; fi
}

# The environment lives outside the checkout, keyed by requirements.txt, so clones share it; .venv links to it.
PY=${PYTHON:-python3}
key=$(sha256sum requirements.txt | cut -c1-12)
VENV=${LOONGFORGE_VENV:-$HOME/.cache/loongforge/venv-$key}
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
  echo "setup: creating $VENV (torch wheel and test oracles; a few GB)"
  rm -rf "$VENV"; mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -r requirements.txt
  touch "$VENV/.complete"
  drop_older "$VENV" venv "${LOONGFORGE_VENV:-}"
fi
link_env .venv "$VENV"
# Test-runner extras (requirements-test.txt), added to the environment when missing.
if ! cmp -s requirements-test.txt "$VENV/.test-requirements" 2>/dev/null; then
  "$VENV/bin/pip" install -q -r requirements-test.txt
  cp requirements-test.txt "$VENV/.test-requirements"
fi

# The LeRobot oracle environment (requirements-lerobot.txt says why it is separate): a venv that sees the main one's
# packages through a .pth file, keyed by both requirement files and the rewrite script; .venv-lerobot links to it.
lkey=$(cat requirements.txt requirements-lerobot.txt scripts/lerobot_py311.py | sha256sum | cut -c1-12)
LVENV=${LOONGFORGE_LEROBOT_VENV:-$HOME/.cache/loongforge/lerobot-$lkey}
if [ ! -x "$LVENV/bin/python" ] || [ ! -f "$LVENV/.complete" ]; then
  echo "setup: creating $LVENV (the lerobot test oracle)"
  rm -rf "$LVENV"; mkdir -p "$(dirname "$LVENV")"
  "$PY" -m venv "$LVENV"
  main_site=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  lsite=$("$LVENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$main_site" > "$lsite/loongforge-main.pth"
  "$LVENV/bin/pip" install -q --upgrade pip
  "$LVENV/bin/pip" install -q --no-deps --ignore-requires-python lerobot==0.6.1 torchvision==0.26.0
  "$LVENV/bin/pip" install -q -r requirements-lerobot.txt 2>&1 | grep -v -i "lerobot.*requires\|dependency resolver\|dependency conflicts" || true
  "$LVENV/bin/python" scripts/lerobot_py311.py "$lsite"
  "$LVENV/bin/python" -c "import lerobot.datasets.lerobot_dataset, lerobot.policies, h5py, av, cv2; assert av.__version__.startswith('15.')"
  touch "$LVENV/.complete"
  drop_older "$LVENV" lerobot "${LOONGFORGE_LEROBOT_VENV:-}"
fi
link_env .venv-lerobot "$LVENV"

# The policy server's client oracle (requirements-openpi.txt says why it is separate): openpi-client in a small venv
# of its own, keyed by its requirement file; .venv-openpi links to it.
okey=$(sha256sum requirements-openpi.txt | cut -c1-12)
OVENV=${LOONGFORGE_OPENPI_VENV:-$HOME/.cache/loongforge/openpi-$okey}
if [ ! -x "$OVENV/bin/python" ] || [ ! -f "$OVENV/.complete" ]; then
  echo "setup: creating $OVENV (the openpi-client test oracle)"
  rm -rf "$OVENV"; mkdir -p "$(dirname "$OVENV")"
  "$PY" -m venv "$OVENV"
  "$OVENV/bin/pip" install -q --upgrade pip
  "$OVENV/bin/pip" install -q -r requirements-openpi.txt
  "$OVENV/bin/python" -c "from openpi_client import websocket_client_policy, msgpack_numpy; import metaworld, mujoco"
  touch "$OVENV/.complete"
  drop_older "$OVENV" openpi "${LOONGFORGE_OPENPI_VENV:-}"
fi
link_env .venv-openpi "$OVENV"

flock -u 9
bash scripts/build.sh
