# Source on the lent GPU machine (no package index there): makes the working tree importable as
# locks_hf beside the image's own torch and transformers (its transformers 5.17 is in the supported
# range), plus the wheels carried in .whl/ (pytest-xdist for the parallel GPU suite):
#   source scripts/dev/gpu_env.sh || exit 1
# (.whl/ is git-ignored; fill it on this side with
#  pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#      pytest-xdist execnet -d .whl ; scripts/dev/gpu_check.sh runs the tests on -n 14)
# Each step that fails says so and returns 1, leaving the caller's shell options as they were.
if compgen -G ".whl/*.whl" >/dev/null; then
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        || { echo "gpu_env: installing the wheels of .whl/ failed" >&2; return 1; }
fi
# GPU_TRANSFORMERS=1: the newer transformers and its dependencies carried in .whl/tf/ (not numpy: the image's
# stays), ahead of the image's, e.g. for the GPU suite on the newest supported release; fill it with
#  pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#      --platform manylinux_2_28_x86_64 transformers==5.25.0 -d .whl/tf && rm .whl/tf/numpy-*
SITE=/tmp/site
if [ "${GPU_TRANSFORMERS:-0}" = 1 ]; then
    compgen -G ".whl/tf/*.whl" >/dev/null || { echo "gpu_env: GPU_TRANSFORMERS=1 but .whl/tf/ holds no wheels" >&2; return 1; }
    pip install -q --no-index --no-deps --target /tmp/site-tf .whl/tf/*.whl \
        || { echo "gpu_env: installing the wheels of .whl/tf/ failed" >&2; return 1; }
    SITE=/tmp/site-tf:/tmp/site
fi
# stage_package TREE DEST: TREE's locks_hf/, kernels/ and eval/ as the installed package DEST/locks_hf
stage_package() {
    rm -rf "$2" && mkdir -p "$2" && cp -r "$1/locks_hf" "$2/" && rm -rf "$2/locks_hf/kernels" "$2/locks_hf/eval" \
        && cp -r "$1/kernels" "$2/locks_hf/kernels" && cp -r "$1/eval" "$2/locks_hf/eval"
}
stage_package . /tmp/pk || { echo "gpu_env: copying the tree to /tmp/pk failed" >&2; return 1; }
export PYTHONPATH=$SITE:/tmp/pk
# (from /tmp: `python3 -c` puts the working folder first on the path, and the repository's locks_hf/ has no kernels)
(cd /tmp && python3 -c "import torch, transformers, locks_hf.kernels; print(f'gpu_env: torch {torch.__version__}, transformers {transformers.__version__}, locks_hf from {locks_hf.__file__}')") \
    || { echo "gpu_env: importing locks_hf from /tmp/pk failed" >&2; return 1; }
