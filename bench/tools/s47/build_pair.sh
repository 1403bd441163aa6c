#!/bin/bash
# bench/tools/s47/build_pair.sh PATCH PREFIX [apply] (from the repository root; logs under $OUT):
# builds the amx family of this tree in /tmp/PREFIX_new and of this tree with PATCH reversed in
# /tmp/PREFIX_base, side by side, for an in-process A/B (bench/ab_inproc.py base vs new). With
# "apply": this tree is the base and the tree with PATCH applied the new one (a patch not committed).
PATCH=$1; PREFIX=$2; MODE=${3:-reverse}
for v in base new; do
  mkdir -p /tmp/${PREFIX}_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/${PREFIX}_$v/
  [ $MODE = reverse ] && [ $v = base ] && (cd /tmp/${PREFIX}_base && patch -R -p1 < "$PATCH" > $OUT/patch.log 2>&1)
  [ $MODE = apply ] && [ $v = new ] && (cd /tmp/${PREFIX}_new && patch -p1 < "$PATCH" > $OUT/patch.log 2>&1)
  (cd /tmp/${PREFIX}_$v && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j8 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?" >> $OUT/build_$v.log) &
done
wait
tail -qn1 $OUT/build_*.log
