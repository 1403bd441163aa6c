#!/bin/bash
# AMX test machine (session 57, third call): bash bench/tools/s57/s57c.sh, logs under $OUT. The
# accumulating backward micro-kernels adding their old outputs after the products (late_acc.patch:
# avx512bf16 PairGemm, every family's float32 dV / dK): the backward / varlen / torch tests on every
# family; the float32 backward (amx family: V512x46) in process against the tree without the patch
# at 16 threads, a sacrificial copy first, three orders; issue 11's float32 table at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)" > $OUT/s57c_machine.txt
python3 setup.py build_ext --inplace -j16 > /tmp/s57c_build.log 2>&1; echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> $OUT/s57c_machine.txt
PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_varlen.py tests/test_torch.py tests/test_torch_sdpa.py 2>&1 | tail -n 4 > $OUT/s57c_tests.log
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/s57c_tests.log
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s57/late_acc.patch s57c > /dev/null 2>&1
tail -qn1 $OUT/build_*.log > $OUT/s57c_builds.log; rm -f $OUT/build_*.log $OUT/patch.log
cp -r /tmp/s57c_base /tmp/s57c_base0
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
B=/tmp/s57c_base/fa2cpu; N=/tmp/s57c_new/fa2cpu; Z=/tmp/s57c_base0/fa2cpu
for c in "16 16 2048 0 fp32 9" "16 32 4096 0 fp32 3"; do
  PYTHONPATH=/tmp/s57c_base timeout 90 python3 $M $c $Z $B $N
  PYTHONPATH=/tmp/s57c_base timeout 90 python3 $M $c $Z $N $B
  PYTHONPATH=/tmp/s57c_base timeout 90 python3 $M $c $Z $B $N
done 2>&1 | tee $OUT/s57c_f32_ab.log
echo "ab done at $(( $(date +%s) - T0 )) s" >> $OUT/s57c_f32_ab.log
cd $ROOT
PYTHONPATH=$PWD timeout 150 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32 --reps 3 2>&1 | tee $OUT/s57c_backward_vs_torch16_h32.log
echo "all done at $(( $(date +%s) - T0 )) s"
