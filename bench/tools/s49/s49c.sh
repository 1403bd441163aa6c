#!/bin/bash
# AMX test machine: bash bench/tools/s49/s49c.sh (logs under $OUT). Session 49's backward change
# (hidden_backward.patch: non-finite q / dout / k kept out of hidden pairs) on the amx family at
# 16 threads (4 key splits per kv head there: dq through the partials): the backward against
# the tree without it in one process, both load orders (bench/ab_inproc.py backward), the costs
# of non-finite inputs (nan_cost_bwd.py), then the hardening and backward tests.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
rm -rf /tmp/s49c_base /tmp/s49c_new
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s49/hidden_backward.patch s49c
for c in "16 backward 16 2048 1 bf16 9" "16 backward 16 2048 1 fp32 5" "16 backward 32 4096 1 bf16 5"; do
  (cd /tmp && PYTHONPATH=/tmp/s49c_new python3 $ROOT/bench/ab_inproc.py /tmp/s49c_base/fa2cpu /tmp/s49c_new/fa2cpu $c 2>&1 | tail -n1 | sed 's/^/base-new /')
  (cd /tmp && PYTHONPATH=/tmp/s49c_new python3 $ROOT/bench/ab_inproc.py /tmp/s49c_new/fa2cpu /tmp/s49c_base/fa2cpu $c 2>&1 | tail -n1 | sed 's/^/new-base /')
done 2>&1 | tee $OUT/s49c_ab.log
(cd /tmp && python3 $ROOT/bench/tools/s49/nan_cost_bwd.py /tmp/s49c_base/fa2cpu /tmp/s49c_new/fa2cpu 16) 2>&1 | tee -a $OUT/s49c_ab.log
cp -r tests /tmp/s49c_new/ && cd /tmp/s49c_new && OMP_NUM_THREADS=16 PYTHONPATH=/tmp/s49c_new timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_hardening.py tests/test_backward.py tests/test_varlen.py > $OUT/s49c_tests_amx.log 2>&1
tail -n3 $OUT/s49c_tests_amx.log
