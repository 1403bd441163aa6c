#!/bin/bash
# AMX test machine (session 57, second call): bash bench/tools/s57/s57b.sh, logs under $OUT. Issue 13's
# int8 / bf16 cache ratio at 16 threads (two runs) and issue 11's bwd / fwd at H=32 N=4096 without
# torch in the process (s57a's backward_vs_torch.py read fp32 full 2.72, bf16 full 2.84).
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)" > $OUT/s57b_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s57b_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s57b_machine.txt
for i in 1 2; do PYTHONPATH=$PWD timeout 120 python3 bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 9; done 2>&1 | tee $OUT/s57b_kv_quant16.log
for d in fp32 bf16; do PYTHONPATH=$PWD timeout 150 python3 bench/tools/s55/scaling.py 32 4096 0 $d 5 16; done 2>&1 | tee $OUT/s57b_scaling16.log
echo "all done at $(( $(date +%s) - T0 )) s"
