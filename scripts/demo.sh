#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: examples/demo.py. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
