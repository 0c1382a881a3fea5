#!/usr/bin/env bash
# mypy over the package as it installs (CI and the pre-commit hook run this). kernels/ and eval/ become
# locks_hf.kernels and locks_hf.eval through pyproject.toml's package-dir, which mypy cannot follow in the
# source tree (nor through an editable install's import hook), so it checks a copy laid out as the wheel is.
# Arguments go to mypy; the settings are pyproject.toml's [tool.mypy].
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cp -r "$root/locks_hf" "$stage/locks_hf"
rm -rf "$stage/locks_hf/kernels" "$stage/locks_hf/eval"  # links a development tree may have
cp -r "$root/kernels" "$stage/locks_hf/kernels"
cp -r "$root/eval" "$stage/locks_hf/eval"
cd "$stage"
mypy --config-file "$root/pyproject.toml" "$@"
