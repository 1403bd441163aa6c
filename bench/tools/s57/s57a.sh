#!/bin/bash
# AMX test machine (session 57): bash bench/tools/s57/s57a.sh, logs under $OUT. The tree as committed
# (avx512bf16 backward: two-block updates, K^T / row pairs by transposes, bf16 rows as they are; the
# amx policy's packing moved to the shared Bf16RowStage / transpose_bf16_rows): the backward / varlen
# / torch tests on every family; the amx backward in process against the tree before (bwd_bf16_s57.patch
# reversed) at 16 threads, a sacrificial copy first, three orders; issue 11's tables at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s57a_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s57a_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s57a_machine.txt
python3 -c "import fa2cpu; print(fa2cpu.available_isas())" >> $OUT/s57a_machine.txt 2>&1
PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 15 > $OUT/s57a_tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s57a_tests.log
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s57/bwd_bf16_s57.patch s57 > /dev/null 2>&1
tail -qn1 $OUT/build_*.log > $OUT/s57a_builds.log; cat $OUT/patch.log >> $OUT/s57a_builds.log; rm -f $OUT/build_*.log $OUT/patch.log
echo "builds done at $(( $(date +%s) - T0 )) s" >> $OUT/s57a_builds.log
cp -r /tmp/s57_base /tmp/s57_base0
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
B=/tmp/s57_base/fa2cpu; N=/tmp/s57_new/fa2cpu; Z=/tmp/s57_base0/fa2cpu
for c in "16 16 2048 0 bf16 21" "16 32 4096 0 bf16 5"; do
  PYTHONPATH=/tmp/s57_base timeout 60 python3 $M $c $Z $B $N
  PYTHONPATH=/tmp/s57_base timeout 60 python3 $M $c $Z $N $B
  PYTHONPATH=/tmp/s57_base timeout 60 python3 $M $c $Z $B $N
done 2>&1 | tee $OUT/s57a_amx_ab.log
echo "ab done at $(( $(date +%s) - T0 )) s" >> $OUT/s57a_amx_ab.log
cd $ROOT
PYTHONPATH=$PWD timeout 200 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3 2>&1 | tee $OUT/s57a_backward_vs_torch16_h32.log
PYTHONPATH=$PWD timeout 120 python3 bench/backward_vs_torch.py --threads 16 --heads 16 --n 2048 --dtypes fp32,bf16 --reps 5 2>&1 | tee $OUT/s57a_backward_vs_torch16_h16.log
echo "all done at $(( $(date +%s) - T0 )) s"
