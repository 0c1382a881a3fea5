#!/usr/bin/env bash
# The test command: installs everything (scripts/setup.sh), then runs the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m pytest -q -p no:cacheprovider "$@"
