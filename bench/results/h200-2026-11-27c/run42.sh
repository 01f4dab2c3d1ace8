#!/bin/bash
# usage (device machine): bash .devrun/run42.sh COMMIT
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1 TIDAL_COMMIT=$1
echo "commit $1 $(date -u +%H:%M:%S)"
echo "== all GPU-marked tests $(date -u +%H:%M:%S)"
timeout 165 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | grep -v -i "warn" | tail -30 | tee $OUT/gputests.log
for way in auto rows; do
  echo "== $way $(date -u +%H:%M:%S)"
  timeout 45 python3 bench/train.py --device cuda --checkpointing off --shared-attention $way 2>&1 | grep -v -i warn \
    | tee $OUT/way-$way.log
done
echo "== done $(date -u +%H:%M:%S)"
