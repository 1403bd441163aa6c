#!/bin/bash
# AMX test machine: bash bench/tools/s52/s52a.sh (logs under $OUT). The backward's row prefetch
# (row_prefetch.patch) against the tree without it, in process (bwd_multi.py, a sacrificial copy
# of base loaded first), 16 threads and 1 thread (8 key splits per kv head there); the backward
# tests on the amx family at 16 threads; issue 11's backward_vs_torch at 16 threads. Also a
# build with fused_dq_reduction.patch on top (fuse). The tests and backward_vs_torch only with FULL=1.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/s52a_machine.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s52/row_prefetch.patch s52a
cp -r /tmp/s52a_base /tmp/s52a_base2
# fuse: the tree with the dq reduction run by each kv head's last split (fused_dq_reduction.patch)
mkdir -p /tmp/s52a_fuse && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s52a_fuse/
(cd /tmp/s52a_fuse && patch -p1 < $ROOT/bench/tools/s52/fused_dq_reduction.patch > $OUT/patch_fuse.log 2>&1 && rm -f fa2cpu/*.so fa2cpu/_core.cpp && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j16 > $OUT/build_fuse.log 2>&1; echo "build fuse rc=$?")
cd /tmp
M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 bf16 9" "16 16 2048 1 bf16 9" "1 4 2048 0 bf16 5"; do
  PYTHONPATH=/tmp/s52a_new python3 $M $c /tmp/s52a_base2/fa2cpu /tmp/s52a_base/fa2cpu /tmp/s52a_new/fa2cpu /tmp/s52a_fuse/fa2cpu
  PYTHONPATH=/tmp/s52a_new python3 $M $c /tmp/s52a_base2/fa2cpu /tmp/s52a_fuse/fa2cpu /tmp/s52a_new/fa2cpu /tmp/s52a_base/fa2cpu
done 2>&1 | tee $OUT/s52a_row_prefetch_ab.log
[ "$FULL" = 1 ] || exit 0
(cd /tmp/s52a_new && cp -r $ROOT/tests . && OMP_NUM_THREADS=16 timeout 150 python3 -m pytest -q -x tests/test_backward.py -p no:cacheprovider > $OUT/s52a_tests.log 2>&1; tail -n2 $OUT/s52a_tests.log)
cd /tmp/s52a_new && PYTHONPATH=/tmp/s52a_new timeout 120 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --dtypes fp32,bf16 --reps 3 2>&1 | tee $OUT/s52a_backward_vs_torch16.log
