# Source on the lent GPU machine (no package index there): makes the working tree importable as
# locks_hf with the transformers version of the CPU side, from the wheel carried in .whl/.
#   source scripts/gpu_env.sh
# (.whl/ is git-ignored; fill it on this side with
#  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#      transformers==5.23.0 pytest-xdist execnet -d .whl ; scripts/gpu_check.sh runs the tests on -n 14)
set -e
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
rm -rf /tmp/pk && mkdir -p /tmp/pk
cp -r locks_hf /tmp/pk/ && cp -r kernels /tmp/pk/locks_hf/kernels && cp -r eval /tmp/pk/locks_hf/eval
export PYTHONPATH=/tmp/site:/tmp/pk
set +e
