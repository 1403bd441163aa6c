#!/bin/bash
# AMX test machine: bash bench/tools/s46/s46b.sh PATCH (logs under $OUT). Builds the amx family of
# this tree (new) and of this tree with PATCH reversed (base), then: transparent huge page
# settings, prefault_probe.py, touch_ab.py at 16 and 8 threads, and the issue 11 benchmark at 16.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s46; PATCH=$1
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag > $OUT/thp.txt; uname -r >> $OUT/thp.txt
for v in base new; do
  mkdir -p /tmp/v_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/v_$v/
  [ $v = base ] && (cd /tmp/v_base && patch -R -p1 < $PATCH > $OUT/patch.log 2>&1)
  (cd /tmp/v_$v && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j8 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -qn1 $OUT/build_*.log
cd /tmp
for mb in 48 16; do python3 $HERE/prefault_probe.py 16 $mb; done 2>&1 | tee $OUT/prefault_probe.log
export PYTHONPATH=/tmp/v_new
(python3 $HERE/touch_ab.py /tmp/v_base/fa2cpu /tmp/v_new/fa2cpu 16 7 16 32
 taskset -c 0-7 python3 $HERE/touch_ab.py /tmp/v_base/fa2cpu /tmp/v_new/fa2cpu 8 5 16
 python3 $HERE/touch_ab.py /tmp/v_base/fa2cpu /tmp/v_new/fa2cpu 16 7 16) 2>&1 | tee $OUT/touch_ab.log
cd $ROOT && PYTHONPATH=/tmp/v_new timeout 150 python3 bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 5 2>&1 | tee $OUT/bwd_torch_16thr_new.log
