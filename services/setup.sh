#!/usr/bin/env bash
# Create .venv and install pipellm into it. Usage: bash services/setup.sh [test]
# torch comes first, pinned to 2.13.0 (the CPU build on this project's machines) so that pip
# never resolves a multi-GB CUDA build as a dependency of something else. Then the default model
# (SmolLM2-135M-Instruct, shared/default_model.py) is fetched once into ~/.cache/pipellm.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="compute${1:+,$1}"  # compute: the model's packages (torch, Triton); every service else
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[$extras]"
.venv/bin/python -m shared.default_model
