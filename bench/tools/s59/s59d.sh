#!/bin/bash
# AMX test machine (session 59, fourth call): issue 11's table at 16 threads (HEAD), and the decode's
# fixed cost per call at 16 threads (issue 13's shape with few keys). Logs under $OUT.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > $OUT/s59d_issue11.log
python3 setup.py build_ext --inplace -j16 > /tmp/s59d_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s59d_issue11.log
{ for nk in 16; do PYTHONPATH=$ROOT timeout 40 python3 bench/kv_quant.py --threads 16 --nk $nk --caches bf16,int8 --reps 41; done
  PYTHONPATH=$ROOT timeout 60 python3 bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 15; } > $OUT/s59d_decode.log 2>&1
{ PYTHONPATH=$ROOT timeout 200 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3
  } >> $OUT/s59d_issue11.log 2>&1
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/s59d_issue11.log
