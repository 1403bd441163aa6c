#!/bin/bash
# AMX test machine: bash bench/tools/s46/s46e.sh (logs under $OUT). Builds the amx family of this
# tree (new: large gradients allocated empty and zeroed by every thread, _core.zero_fill) and of
# this tree with zero_fill.patch reversed (base), then touch_ab.py base vs new at 16 threads.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s46
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
for v in base new; do
  mkdir -p /tmp/z_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/z_$v/
  [ $v = base ] && (cd /tmp/z_base && patch -R -p1 < $HERE/zero_fill.patch > $OUT/patch.log 2>&1)
  (cd /tmp/z_$v && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j8 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -qn1 $OUT/build_*.log
cd /tmp && PYTHONPATH=/tmp/z_new python3 $HERE/touch_ab.py /tmp/z_base/fa2cpu /tmp/z_new/fa2cpu 16 7 16 32 2>&1 | grep -v "^forward" | tee $OUT/zero_fill_ab.log
