#!/bin/bash
# AMX test machine (session 56): bash bench/tools/s56/s56c.sh, logs under $OUT. bf16 items' scratch
# budget 96 MB instead of 48 (bf16_budget96.patch: bf16 H=32 N=4096 on 16 CPUs in 2 key splits, so
# the fine tail applies, instead of 4): in process against the tree at 16 threads, a sacrificial
# copy first and three orders; run it on a clean tree (build_pair.sh ... apply).
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)" > $OUT/s56c_machine.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s56/bf16_budget96.patch s56c apply > /dev/null 2>&1
(cd /tmp/s56c_new && grep -c "BUDGET_MB 96" csrc/driver/backward.cpp) >> $OUT/s56c_machine.txt 2>&1
tail -qn1 $OUT/build_*.log >> $OUT/s56c_machine.txt; rm -f $OUT/build_*.log $OUT/patch.log
echo "builds done at $(( $(date +%s) - T0 )) s" >> $OUT/s56c_machine.txt
cp -r /tmp/s56c_base /tmp/s56c_base0
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
B=/tmp/s56c_base/fa2cpu; N=/tmp/s56c_new/fa2cpu; Z=/tmp/s56c_base0/fa2cpu
for c in "16 32 4096 0 bf16 5" "16 32 4096 1 bf16 7" "16 16 4096 0 bf16 5"; do
  PYTHONPATH=/tmp/s56c_base timeout 90 python3 $M $c $Z $B $N
  PYTHONPATH=/tmp/s56c_base timeout 90 python3 $M $c $Z $N $B
  PYTHONPATH=/tmp/s56c_base timeout 90 python3 $M $c $Z $B $N
done 2>&1 | tee $OUT/s56c_budget96_ab.log
cd /tmp/s56c_new && PYTHONPATH=/tmp/s56c_new timeout 150 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes bf16 --reps 3 2>&1 | tee $OUT/s56c_backward_vs_torch16_new.log
echo "all done at $(( $(date +%s) - T0 )) s"
