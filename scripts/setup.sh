#!/usr/bin/env bash
# Creates .venv and installs earlywarn with its test/demo dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned here (the CPU build that CI machines have on local disk); the package itself
# only asks for a range. Everything else comes from pyproject's [dev] extra.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
# torchvision's PyPI wheel beside the CPU build of torch: see scripts/torchvision_cpu_shim.py
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_cpu_shim.py "$site/_earlywarn_torchvision_cpu_shim.py"
echo "import _earlywarn_torchvision_cpu_shim" > "$site/_earlywarn_torchvision_cpu_shim.pth"
.venv/bin/python -c "import earlywarn, torch, mlflow, wandb, torchvision, transformers" || { echo "setup failed: see pip output above" >&2; exit 1; }
