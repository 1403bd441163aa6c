#!/bin/bash
# AMX test machine: bash bench/tools/s46/s46c.sh PATCH (logs under $OUT). Builds the amx family of
# this tree (new: gradients' pages touched before the backward), of this tree with PATCH reversed
# (base), and of this tree with FA2CPU_BWD_ITEMS_PER_CPU = 2, 3, 6, 8 (default 4); then transparent
# huge page settings, prefault_probe.py, touch_ab.py (base vs new; the forward's potential), and
# bwd_multi.py over the item counts at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s46; PATCH=$1
(cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; uname -r; lscpu | grep -E "Model name|^Model:|^CPU\(s\)") > $OUT/machine.txt
for v in base new i2 i3 i6 i8; do
  mkdir -p /tmp/v_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v_$v/
  [ $v = base ] && (cd /tmp/v_base && patch -R -p1 < $PATCH > $OUT/patch.log 2>&1)
  F=""; case $v in i*) F="-DFA2CPU_BWD_ITEMS_PER_CPU=${v#i}";; esac
  (cd /tmp/v_$v && FA2CPU_DISABLE=avx512bf16,avx512,avx2 FA2CPU_EXTRA_CFLAGS="$F" python3 setup.py build_ext --inplace -j3 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -qn1 $OUT/build_*.log
cd /tmp
for mb in 48 16; do python3 $HERE/prefault_probe.py 16 $mb; done 2>&1 | tee $OUT/prefault_probe.log
export PYTHONPATH=/tmp/v_new
python3 $HERE/touch_ab.py /tmp/v_base/fa2cpu /tmp/v_new/fa2cpu 16 7 16 32 2>&1 | tee $OUT/touch_ab.log
V="/tmp/v_new/fa2cpu /tmp/v_i2/fa2cpu /tmp/v_i3/fa2cpu /tmp/v_i6/fa2cpu /tmp/v_i8/fa2cpu"
(python3 $HERE/bwd_multi.py 16 0 fp32 7 16 2048 $V
 python3 $HERE/bwd_multi.py 16 1 fp32 7 16 2048 $V
 python3 $HERE/bwd_multi.py 16 0 bf16 7 16 2048 $V
 python3 $HERE/bwd_multi.py 16 1 bf16 7 16 2048 $V
 python3 $HERE/bwd_multi.py 16 0 fp32 5 32 4096 $V) 2>&1 | tee $OUT/items_sweep.log
