#!/usr/bin/env bash
# Create .venv and install pipellm into it. Usage: bash scripts/setup.sh [test]
# torch comes first, pinned to 2.13.0 (the CPU build on this project's machines) so that pip
# never resolves a multi-GB CUDA build as a dependency of something else. Then the default model
# (SmolLM2-135M-Instruct, pipellm/shared/default_model.py) is fetched once into ~/.cache/pipellm, and
# the C++ CPU kernels (pipellm/kernels/cpu) are compiled once into torch's extension cache
# ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), so that the server's first start loads
# them instead of compiling them (~50 s). A failed build does not fail setup: the server then
# runs the PyTorch reference kernels. With `test`, also the router the scale-out test runs
# (vllm-router).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="compute${1:+,$1}"  # compute: the model's packages (torch, Triton); every service else
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[$extras]"
# tests: the router tests/test_router.py puts in front of two servers (pinned: the test checks
# how this version routes, health-checks and rewrites requests)
case ",${1:-}," in *,test,*) "${pip[@]}" vllm-router==0.1.17 ;; esac
.venv/bin/python -m pipellm.shared.default_model
.venv/bin/python -m pipellm.kernels.cpu || echo "setup: the C++ CPU kernels did not build; the server" \
    "runs the PyTorch reference kernels instead (slower on a CPU)"
