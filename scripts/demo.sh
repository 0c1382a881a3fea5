#!/usr/bin/env bash
# The main command: installs everything (scripts/setup.sh), then runs the needle-in-a-haystack demo
# on Gemma 3 270M (full attention, Locks r8i4, the exact-LSE oracle and Quest at b=128).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python scripts/demo.py "$@"
