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
  libavcodec-dev libavformat-dev libavutil-dev libswscale-dev"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q $missing
fi

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
  # environments of older requirements.txt versions are a few GB each: drop them
  if [ -z "${LOONGFORGE_VENV:-}" ]; then
    for old in "$(dirname "$VENV")"/venv-*; do
      if [ "$old" != "$VENV" ]; then rm -rf "$old"; fi
    done
  fi
fi
if [ "$(readlink -f .venv 2>/dev/null)" != "$(readlink -f "$VENV")" ]; then rm -rf .venv; ln -s "$VENV" .venv; fi

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
  if [ -z "${LOONGFORGE_LEROBOT_VENV:-}" ]; then
    for old in "$(dirname "$LVENV")"/lerobot-*; do
      if [ "$old" != "$LVENV" ]; then rm -rf "$old"; fi
    done
  fi
fi
if [ "$(readlink -f .venv-lerobot 2>/dev/null)" != "$(readlink -f "$LVENV")" ]; then
  rm -rf .venv-lerobot; ln -s "$LVENV" .venv-lerobot
fi

flock -u 9
bash scripts/build.sh
