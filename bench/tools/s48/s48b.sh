#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48b.sh (logs under $OUT). As s48a.sh after the kept
# gradients' 4 MB+ blocks became 2 MB aligned and madvised: kept against np.empty at 16 and 2
# threads, issue 11's table at 16 threads for H=16 N=2048 and H=32 N=4096.
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/build_amx.sh /tmp/w
cd /tmp/w && {
  for c in "16 16 2048 0 bf16 11" "16 16 2048 1 bf16 11" "16 16 2048 0 fp32 7" "16 16 2048 1 fp32 7" "16 32 4096 0 bf16 5" "16 32 4096 0 fp32 3" "2 16 2048 0 bf16 5" "2 16 2048 1 fp32 3"; do
    PYTHONPATH=/tmp/w python3 bench/tools/s48/kept_gradients_ab.py $c
  done
  PYTHONPATH=/tmp/w python3 bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 5
  PYTHONPATH=/tmp/w python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3
} 2>&1 | tee $OUT/s48b.log
