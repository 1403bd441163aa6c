#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48g.sh (logs under $OUT). The machine's topology, then
# issue 13's and issue 12's figures at 16 threads on this session's library (amx family).
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/build_amx.sh /tmp/w
lscpu > $OUT/lscpu.txt
cd /tmp/w && {
  grep -E "^Thread|^Core|^Socket|^NUMA node\(s\)|^CPU\(s\)|L2|L3" $OUT/lscpu.txt
  PYTHONPATH=/tmp/w python3 bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9
  PYTHONPATH=/tmp/w python3 bench/vs_torch.py --threads 16 --cases prefill --reps 3
} 2>&1 | tee $OUT/s48g.log
