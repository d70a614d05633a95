#!/usr/bin/env bash
# GPU first light on the lent GPU machine, from the repository root: installs the wheels `make gpu-wheels` put in
# build/gpu-wheels (carried there; the image has an older transformers and no pydantic) into /tmp/site, without
# their dependencies (the image has those), then runs bench/gpu_first_light.py with these arguments. Needs no Ray
# or MLflow. bench/results/gpu_first_light.md says how to carry the wheels and what each section checks.
#
#   bash bench/gpu_first_light.sh --device cuda [--budget-s 400]
set -euo pipefail

WHEELS=build/gpu-wheels
if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "no wheels in $WHEELS: run 'make gpu-wheels' here and carry $WHEELS to the GPU machine" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/*.whl
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ -n "${OUT:-}" ]; then
  python3 bench/gpu_first_light.py "$@" 2>&1 | tee "$OUT/gpu_first_light.log"
else
  python3 bench/gpu_first_light.py "$@"
fi
