#!/bin/bash
# AMX test machine: bash bench/tools/s54/s54b.sh (logs under $OUT). The dq sums queued behind the
# items in one parallel_for (this tree) against the tree without it (dq_chunks.patch reversed),
# amx family, in process at 16 threads (a sacrificial copy of base
# first, both orders); then the backward tests at 16 threads on the amx family and issue 11's
# backward_vs_torch at 16 threads from the new build.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "^Model:|^CPU\(s\)|L2|L3" > $OUT/s54b_machine.txt
for d in base new; do mkdir -p /tmp/s54b_$d && cp -r setup.py pyproject.toml fa2cpu csrc README.md /tmp/s54b_$d/; done
(cd /tmp/s54b_base && patch -R -p1 < $ROOT/bench/tools/s54/dq_chunks.patch > /dev/null; echo "patch rc=$?")
for d in base new; do
  (cd /tmp/s54b_$d && rm -f fa2cpu/*.so && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j8 > /tmp/build_$d.log 2>&1; echo "build $d rc=$?") &
done
wait
cp -r /tmp/s54b_base /tmp/s54b_base2
cd /tmp; M=$ROOT/bench/tools/s52/bwd_multi.py
for c in "16 16 2048 0 bf16 11" "16 16 2048 1 bf16 11" "16 16 2048 0 fp32 5" "16 32 4096 0 bf16 3"; do
  PYTHONPATH=/tmp/s54b_base timeout 80 python3 $M $c /tmp/s54b_base2/fa2cpu /tmp/s54b_base/fa2cpu /tmp/s54b_new/fa2cpu
  PYTHONPATH=/tmp/s54b_base timeout 80 python3 $M $c /tmp/s54b_base2/fa2cpu /tmp/s54b_new/fa2cpu /tmp/s54b_base/fa2cpu
done 2>&1 | tee $OUT/s54b_dq_chunks_ab.log
cp -r $ROOT/tests /tmp/s54b_new/ && cd /tmp/s54b_new && OMP_NUM_THREADS=16 PYTHONPATH=/tmp/s54b_new timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_backward.py 2>&1 | tail -3 > $OUT/s54b_tests.log
cd /tmp/s54b_new && for hn in "16 2048" "32 4096"; do set -- $hn
  PYTHONPATH=/tmp/s54b_new timeout 100 python3 $ROOT/bench/backward_vs_torch.py --threads 16 --heads $1 --n $2 --dtypes fp32,bf16 --reps 3
done 2>&1 | tee $OUT/s54b_backward_vs_torch16.log
