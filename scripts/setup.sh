#!/usr/bin/env bash
# Creates .venv and installs earlywarn (editable) with its test/demo dependencies. Idempotent: a
# .venv set up from the same pyproject.toml, constraints and this script is left as it is (silent).
# Says what it is doing while it installs; pip's own output is shown only when something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.earlywarn-setup
start=$SECONDS

want=$(cat pyproject.toml scripts/constraints.txt scripts/setup.sh scripts/torchvision_cpu_shim.py | "$PY" -c \
  "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] \
   && .venv/bin/python -c "import earlywarn, torch, mlflow, wandb, torchvision, transformers" 2>/dev/null; then
  exit 0
fi

# step N "what": prints "[setup] N/5 what ... " now and the seconds it took when the pip run ends
step() {
  local n=$1 what=$2 t0=$SECONDS log
  shift 2
  printf '[setup] %s/5 %s ... ' "$n" "$what"
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    echo "failed"
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    echo "[setup] failed: pip install $* (pip's output above)" >&2
    exit 1
  fi
  echo "$((SECONDS - t0)) s"
  grep "^ERROR" "$log" >&2 || true  # pip reports dependency conflicts this way and still exits 0
  rm -f "$log"
}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version 2>&1) (first run: a few minutes in all)"
  "$PY" -m venv .venv
fi
# torch is pinned here (the CPU build that CI machines have on local disk); the package itself
# only asks for a range. Everything else comes from pyproject's extras, [dev] being all of them.
step 1 "torch 2.13.0 (CPU build)" "torch==2.13.0"
step 2 "earlywarn and the trackers (mlflow, wandb)" -c scripts/constraints.txt -e ".[mlflow,wandb]"
step 3 "frameworks the tests train in (transformers, accelerate, lightning, torchdata)" \
  -c scripts/constraints.txt -e ".[huggingface,lightning,data]"
step 4 "test tools and the ecosystems the conformance suite trains in (peft, timm, diffusers, trl, ...)" \
  -c scripts/constraints.txt -e ".[dev]"
# litgpt's own pins (huggingface-hub<1.4) exclude what diffusers and trl need: without its deps
# (the suite uses its model and Fabric loop: torch and lightning, both installed above)
step 5 "litgpt (without its pins: see scripts/constraints.txt)" -c scripts/constraints.txt --no-deps litgpt
# torchvision's PyPI wheel beside the CPU build of torch: see scripts/torchvision_cpu_shim.py
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_cpu_shim.py "$site/_earlywarn_torchvision_cpu_shim.py"
echo "import _earlywarn_torchvision_cpu_shim" > "$site/_earlywarn_torchvision_cpu_shim.pth"
.venv/bin/python -c "import earlywarn, torch, mlflow, wandb, torchvision, transformers" \
  || { echo "[setup] failed: the installed packages do not import (see above)" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "[setup] ready in $((SECONDS - start)) s: .venv/bin/python, .venv/bin/earlywarn, .venv/bin/mlflow" \
     "(or 'source .venv/bin/activate' to have them on PATH)"
