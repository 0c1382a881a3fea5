# Source on the lent GPU machine (no package index there): makes the working tree importable as
# locks_hf beside the image's own torch and transformers (its transformers 5.17 is in the supported
# range), plus the wheels carried in .whl/ (pytest-xdist for the parallel GPU suite):
#   source scripts/gpu_env.sh
# (.whl/ is git-ignored; fill it on this side with
#  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#      pytest-xdist execnet -d .whl ; scripts/gpu_check.sh runs the tests on -n 14)
set -eo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
rm -rf /tmp/pk && mkdir -p /tmp/pk
cp -r locks_hf /tmp/pk/ && cp -r kernels /tmp/pk/locks_hf/kernels && cp -r eval /tmp/pk/locks_hf/eval
export PYTHONPATH=/tmp/site:/tmp/pk
python3 -c "import torch, transformers, locks_hf; print(f'gpu_env: torch {torch.__version__}, transformers {transformers.__version__}, locks_hf from {locks_hf.__file__}')"
set +eo pipefail
