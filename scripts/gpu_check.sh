#!/usr/bin/env bash
# On the lent GPU machine: compiled-kernel tests (incl. the static cache's compiled generate, the
# one-liner's compiled generate across budgets and through a growth, and the sweep engine's graph /
# compiled steps), the eigensolver check, then the complete decode step under
# CUDA graphs (scripts/gpu_step.sh).
source scripts/gpu_env.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
# Compiling every kernel variant cold is most of the run (the unrolled "fma" scoring kernel alone takes
# ~20 s per specialization on one core, docs/compile_time.md, and the tests need dozens): spread the
# tests over the host's cores (on the H200, 2026-11-29: 114 tests in 227 s on 14 workers; one process: 58 in 320 s).
(cd /tmp/pk && timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -n "${WORKERS:-14}" -v --durations=25 -rfE \
    tests/test_kernels.py tests/test_rerank_kernels.py tests/test_eigh.py tests/test_page_update.py tests/test_static_cache.py \
    tests/test_sweep_engine.py::test_cuda_graph_and_compiled_steps_equal_the_eager_step_on_cuda \
    tests/test_layout.py::test_one_liner_compiles_once_across_budgets_on_cuda \
    tests/test_layout.py::test_one_liner_grows_during_compiled_decode_on_cuda \
    -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/pytest.txt" 2>&1; tail -40 "$OUT/pytest.txt" | cut -c1-200)
[ -n "$SKIP_EIGH" ] || timeout 120 python3 scripts/check_eigh_gpu.py 2>&1 | tail -30
bash scripts/gpu_step.sh
