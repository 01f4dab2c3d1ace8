#!/bin/bash
# usage (device machine): bash .devrun/run40.sh COMMIT
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1 TIDAL_COMMIT=$1
echo "commit $1 $(date -u +%H:%M:%S)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'flash', torch.backends.cuda.is_flash_attention_available())"
echo "== gpu tests of the new code $(date -u +%H:%M:%S)"
timeout 150 python3 -m pytest -m gpu -q tests/test_train_kernels.py tests/test_model.py 2>&1 | tail -40 | tee $OUT/tests.log
echo "== train bench $(date -u +%H:%M:%S)"
timeout 330 python3 bench/train.py --device cuda --repeats 3 --eager off --profile $OUT/train-prof 2>&1 \
  | grep -v Warning | tee $OUT/train.log
rc=$?
echo "== rows $(date -u +%H:%M:%S)"
if [ $rc -eq 0 ]; then
  timeout 80 python3 bench/train.py --device cuda --repeats 1 --checkpointing off --shared-attention rows 2>&1 \
    | grep -v Warning | tee $OUT/rows.log
else
  timeout 200 python3 bench/train.py --device cuda --repeats 2 --checkpointing '' --eager off,on --shared-attention rows \
    2>&1 | grep -v Warning | tee $OUT/fallback.log
fi
echo "== done $(date -u +%H:%M:%S)"
