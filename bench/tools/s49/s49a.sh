#!/bin/bash
# AMX test machine: bash bench/tools/s49/s49a.sh (logs under $OUT). Session 49's forward change
# (hidden_values.patch: non-finite V of hidden keys kept out of other rows) on the amx family:
# the forward against the tree without it in one process (bench/ab_inproc.py, base / new) at 16
# threads, the costs of NaN q rows / inf in V (nan_cost.py), then the forward, hardening, varlen
# and KV-cache tests on the amx family at 16 threads (split plans of a 16-CPU machine).
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
rm -rf /tmp/s49_base /tmp/s49_new
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s49/hidden_values.patch s49  # (an absolute path: build_pair patches from /tmp)
for c in "16 32 4096 1 bf16 7" "16 32 4096 0 bf16 7" "16 16 2048 1 bf16 9" "16 16 2048 1 fp32 7" "16 32 4096 1 fp32 5" "1 4 4096 1 bf16 5"; do
  (cd /tmp && PYTHONPATH=/tmp/s49_new python3 $ROOT/bench/ab_inproc.py /tmp/s49_base/fa2cpu /tmp/s49_new/fa2cpu $c 2>&1 | tail -n1)
done 2>&1 | tee $OUT/s49a_ab.log
(cd /tmp && python3 $ROOT/bench/tools/s49/nan_cost.py /tmp/s49_base/fa2cpu /tmp/s49_new/fa2cpu 16) 2>&1 | tee -a $OUT/s49a_ab.log
cp -r tests /tmp/s49_new/ && cd /tmp/s49_new && OMP_NUM_THREADS=16 PYTHONPATH=/tmp/s49_new timeout 400 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_hardening.py tests/test_forward.py tests/test_varlen.py tests/test_kvcache.py tests/test_kvcache_quant.py > $OUT/s49a_tests_amx.log 2>&1
tail -n3 $OUT/s49a_tests_amx.log
