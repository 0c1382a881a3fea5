#!/usr/bin/env bash
# Checks locks-hf against the torch and transformers versions you name, installed the way users install
# it: the wheel built from this tree, in a fresh virtualenv, imported and tested from outside the tree.
#
#   bash scripts/check_versions.sh --torch 2.11.0 --transformers 5.17.0            # compatibility subset
#   bash scripts/check_versions.sh --torch 2.15.0 --transformers 5.25.0 --python 3.13 --suite full
#   bash scripts/check_versions.sh --suite smoke      # the installed torch's version, newest transformers
#
# --suite smoke   import locks_hf / .kernels / .eval from the wheel, generate() with LocksCache on a tiny
#                 model, `locks-hf-eval --help`, and a short RULER sweep on the tiny model;
# --suite compat  smoke + the tests marked `compat` (cache API, generate() with padding, beams and
#                 sampling, the static layout, fork, a sweep smoke run);
# --suite full    smoke + the whole suite.
# Virtualenvs live under $LOCKS_HF_VENVS (default: a folder under the system temp dir) and are kept, so a
# second check of the same versions reinstalls only the wheel; pip's own cache keeps the downloads.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCH="" TF="" PYVER="" SUITE=compat
while [ $# -gt 0 ]; do
    case "$1" in
        --torch) TORCH="$2"; shift 2 ;;
        --transformers) TF="$2"; shift 2 ;;
        --python) PYVER="$2"; shift 2 ;;
        --suite) SUITE="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "check_versions.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$SUITE" in smoke|compat|full) ;; *) echo "check_versions.sh: --suite is smoke, compat or full, got '$SUITE'" >&2; exit 2 ;; esac
# The Python that runs this script builds the wheel (pyenv's selection below must not change it).
BUILD_PY="$(python -c 'import sys; print(sys.executable)')"
[ -n "$TORCH" ] || TORCH="$("$BUILD_PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
PY="python${PYVER}"
if [ -n "$PYVER" ] && ! "$PY" -c "" 2>/dev/null && command -v pyenv >/dev/null; then
    # pyenv's shims answer only for the selected versions: select the newest installed $PYVER.x
    PYENV_VERSION="$(pyenv versions --bare | grep -E "^${PYVER//./\\.}\.[0-9]+$" | sort -V | tail -1)"
    export PYENV_VERSION
fi
"$PY" -c "" 2>/dev/null || { echo "check_versions.sh: no working '$PY' (install Python $PYVER or drop --python)" >&2; exit 2; }
# A machine-wide pip constraint file (some CI images cap torch) would make a newer torch unresolvable:
# this check asks for exact versions, so it replaces it with an empty one.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
PIP_Q="-q"
START=$SECONDS
say() { echo "[check-versions $((SECONDS - START))s] $*"; }

TMP="${TMPDIR:-/tmp}"
VENVS="${LOCKS_HF_VENVS:-$TMP/locks-hf-venvs}"
NAME="py$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-torch$TORCH-transformers${TF:-newest}"
VENV="$VENVS/$NAME"
mkdir -p "$VENVS"
TMP_DIRS=()
trap 'rm -rf "${TMP_DIRS[@]}"' EXIT
WHEELS="$(mktemp -d "$TMP/locks-hf-wheel.XXXXXX")"  # per run: checks of several versions may run at once
TMP_DIRS+=("$WHEELS")

say "building the locks-hf wheel from $ROOT"
"$BUILD_PY" -m pip wheel $PIP_Q --no-deps --no-build-isolation -w "$WHEELS" "$ROOT" >/dev/null
WHEEL="$(ls "$WHEELS"/locks_hf-*.whl)"

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
say "installing torch==$TORCH (a CUDA build where the index has no CPU one: it runs on the CPU too)"
"$VPY" -m pip install $PIP_Q "torch==$TORCH"
say "installing the wheel with its test and eval extras, transformers ${TF:-newest in range}"
"$VPY" -m pip install $PIP_Q --force-reinstall --no-deps "$WHEEL"
"$VPY" -m pip install $PIP_Q "$WHEEL[test,eval]" ${TF:+"transformers==$TF"}
"$VPY" -m pip install $PIP_Q "pytest-timeout>=2.3"
VERSIONS="$("$VPY" -c 'import sys, torch, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")')"
say "installed: $VERSIONS"

# Everything below runs from a folder outside the source tree, so `import locks_hf` can only find the wheel.
WORK="$(mktemp -d "$TMP/locks-hf-check.XXXXXX")"
TMP_DIRS+=("$WORK")
# The tests, scripts, docs and pytest settings travel; the package's sources (locks_hf/, kernels/, eval/) do not.
tar -C "$ROOT" --exclude=./.git --exclude=./locks_hf --exclude=./kernels --exclude=./eval --exclude='*/__pycache__' \
    -cf - . | tar -C "$WORK" -xf -
cd "$WORK"
say "smoke: imports, generate(), CLI help, a RULER sweep (from $WORK)"
"$VPY" - <<'PY'
import pathlib, sys
import torch
import locks_hf, locks_hf.eval, locks_hf.kernels
from locks_hf import LocksCache, LocksConfig
from locks_hf.models import tiny_model

site = pathlib.Path(sys.prefix).resolve()
for mod in (locks_hf, locks_hf.eval, locks_hf.kernels):
    where = pathlib.Path(mod.__file__).resolve()
    assert site in where.parents, f"{mod.__name__} imported from {where}, not from the installed wheel under {site}"
model = tiny_model("llama", attn_implementation="locks", seed=0)
ids = torch.randint(3, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
cache = LocksCache(model.config, LocksConfig.from_label("r4i4", budget=64))
out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
assert out.shape == (2, 158), out.shape
print(f"smoke: generate() with LocksCache ok, locks_hf {locks_hf.__version__} from {pathlib.Path(locks_hf.__file__).parent}")
PY
"$VENV/bin/locks-hf-eval" --help >/dev/null
"$VENV/bin/locks-hf-eval" sweep --benchmark ruler --model tiny-llama --tasks niah_single_1 --lengths 1024 \
    --num-samples 1 --arms full,locks-r4i4 --budgets 128 --max-new-tokens 4 --out "$WORK/sweep" \
    >"$WORK/sweep.log" 2>&1 || { cat "$WORK/sweep.log"; echo "check_versions.sh: the smoke sweep failed" >&2; exit 1; }
test -s "$WORK/sweep/results.jsonl" || { echo "check_versions.sh: the sweep wrote no results.jsonl" >&2; exit 1; }
say "smoke passed ($VERSIONS)"
# A shell or notebook started in a clone's root has the root on sys.path, where the source tree's kernels/ folder
# shadows Hugging Face's `kernels` (a transformers dependency from 5.25 on; earlier releases import it if present).
say "imports from the source tree's root"
(cd "$ROOT" && "$VPY" -c "from transformers import AttentionInterface, AutoModelForCausalLM; import locks_hf, kernels, transformers; \
print('from the root: transformers', transformers.__version__, '- kernels:', getattr(kernels, '__file__', None) or 'not installed')")

case "$SUITE" in
    smoke) exit 0 ;;
    compat) MARK=(-m "compat and not gpu") ;;
    full) MARK=() ;;
esac
say "pytest ($SUITE) on the installed wheel"
"$VPY" -m pytest -q -p no:cacheprovider --tb=short --timeout 900 "${MARK[@]}" tests
say "$SUITE passed ($VERSIONS)"
