#!/bin/bash
# AMX test machine: bash bench/tools/s53/s53a.sh (logs under $OUT). Session 52's s52a.sh for a tree
# without the row prefetch: base = this tree, rp = + bench/tools/s52/row_prefetch.patch, fuse = +
# bench/tools/s52/fused_dq_reduction.patch, each the amx family only; in-process backward A/B at 16
# threads and 1 thread (bwd_multi.py, a sacrificial copy of base loaded first, both orders). Then
# the amx backward tests at 16 threads and issue 11's backward_vs_torch at 16 threads (this tree).
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:|^L2|^L3" > $OUT/s53a_machine.txt
for v in base rp fuse; do
  mkdir -p /tmp/s53_$v && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s53_$v/
  case $v in rp) P=row_prefetch.patch;; fuse) P=fused_dq_reduction.patch;; *) P=;; esac
  (cd /tmp/s53_$v && { [ -z "$P" ] || patch -p1 < $ROOT/bench/tools/s52/$P; } > $OUT/patch_$v.log 2>&1 &&
   FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j6 > $OUT/build_$v.log 2>&1; echo "build $v rc=$?") &
done
wait
cp -r /tmp/s53_base /tmp/s53_base2
cd /tmp
M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 bf16 9" "16 16 2048 1 bf16 9" "1 4 2048 0 bf16 5"; do
  PYTHONPATH=/tmp/s53_base timeout 200 python3 $M $c /tmp/s53_base2/fa2cpu /tmp/s53_base/fa2cpu /tmp/s53_rp/fa2cpu /tmp/s53_fuse/fa2cpu
  PYTHONPATH=/tmp/s53_base timeout 200 python3 $M $c /tmp/s53_base2/fa2cpu /tmp/s53_fuse/fa2cpu /tmp/s53_rp/fa2cpu /tmp/s53_base/fa2cpu
done 2>&1 | tee $OUT/s53a_ab.log
[ "$FULL" = 1 ] || exit 0
cd /tmp/s53_base && PYTHONPATH=/tmp/s53_base timeout 150 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 3 2>&1 | tee $OUT/s53a_backward_vs_torch16.log
