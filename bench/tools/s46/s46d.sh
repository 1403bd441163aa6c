#!/bin/bash
# AMX test machine: bash bench/tools/s46/s46d.sh (logs under $OUT). Builds the amx family of this
# tree (base) and of this tree with half_tail.patch and FA2CPU_BWD_HALF_TAIL=1 (half: the last key
# range of each split kv head half as long), then: bwd_multi.py base vs half at 16 threads; the
# order check of bwd_diag.py (the pre-faulted backward after the public one, then before it).
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s46
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
for v in base half; do
  mkdir -p /tmp/w_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/w_$v/
  F=""; [ $v = half ] && F="-DFA2CPU_BWD_HALF_TAIL=1" && (cd /tmp/w_half && patch -p1 < $HERE/half_tail.patch > $OUT/patch.log 2>&1)
  (cd /tmp/w_$v && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$F" python3 setup.py build_ext --inplace -j8 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -qn1 $OUT/build_*.log
cd /tmp
export PYTHONPATH=/tmp/w_base
V="/tmp/w_base/fa2cpu /tmp/w_half/fa2cpu"
(python3 $HERE/bwd_multi.py 16 0 fp32 7 16 2048 $V
 python3 $HERE/bwd_multi.py 16 1 fp32 7 16 2048 $V
 python3 $HERE/bwd_multi.py 16 0 bf16 9 16 2048 $V
 python3 $HERE/bwd_multi.py 16 1 bf16 9 16 2048 $V
 python3 $HERE/bwd_multi.py 16 0 fp32 5 32 4096 $V
 python3 $HERE/bwd_multi.py 16 0 bf16 9 16 2048 $V) 2>&1 | tee $OUT/half_tail_ab.log
(python3 $HERE/bwd_diag.py 16 bf16 16; python3 $HERE/bwd_diag.py -16 bf16 16; python3 $HERE/bwd_diag.py 16 fp32 32; python3 $HERE/bwd_diag.py -16 fp32 32) 2>&1 | tee $OUT/bwd_diag_order.log
