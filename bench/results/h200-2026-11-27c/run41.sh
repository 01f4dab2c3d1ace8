#!/bin/bash
# usage (device machine): bash .devrun/run41.sh COMMIT
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1 TIDAL_COMMIT=$1
echo "commit $1 $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python3 bench/train.py --device cuda --checkpointing off"
echo "== A/B: fused vs eager, varlen $(date -u +%H:%M:%S)"
timeout 120 $B --repeats 2 --eager off 2>&1 | grep -v -i warn | tee $OUT/ab.log
echo "== C/D: rows $(date -u +%H:%M:%S)"
timeout 75 $B --repeats 1 --eager off --shared-attention rows 2>&1 | grep -v -i warn | tee $OUT/cd.log
echo "== 16k micro-batches $(date -u +%H:%M:%S)"
timeout 75 python3 bench/train.py --device cuda --checkpointing off,on --micro-batch-tokens 16384 2>&1 \
  | grep -v -i warn | tee $OUT/mb16k.log
echo "== done $(date -u +%H:%M:%S)"
