#!/bin/bash
# AMX test machine: bash bench/tools/s49/s49d.sh (logs under $OUT). Issues 11 and 13 at 16 threads
# on this tree (amx family): kv_quant.py twice, backward_vs_torch.py (B=1 H=16 N=2048 D=128).
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/build_amx.sh /tmp/w49
cd /tmp/w49 && {
  for i in 1 2; do PYTHONPATH=/tmp/w49 python3 bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9; done
  PYTHONPATH=/tmp/w49 python3 bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 5
} 2>&1 | tee $OUT/s49d_issues_11_13_16thr.log
