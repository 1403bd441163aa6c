#!/bin/bash
# AMX test machine: bash bench/tools/s51/s51b.sh (logs under $OUT). The paged prefetch aimed
# through the block table and the scales' prefetch (paged_aim.patch = git diff 75c0e2d fb1bd39
# -- csrc) against the tree without them, in process at 16 threads, both load orders; the
# KV-cache tests on the amx family; decode_extras.py at 16 threads for int8 / bf16 caches.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/s51b_machine.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s51/paged_aim.patch s51b
cd /tmp
for cb in "int8 16" "int8 64" "int8 256" "bf16 64" "bf16 256" "fp32 64" "fp32 16"; do set -- $cb
  PYTHONPATH=/tmp/s51b_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 16 $1 $2 7 /tmp/s51b_base/fa2cpu /tmp/s51b_new/fa2cpu | tail -n1
  PYTHONPATH=/tmp/s51b_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 16 $1 $2 7 /tmp/s51b_new/fa2cpu /tmp/s51b_base/fa2cpu | tail -n1
done 2>&1 | tee $OUT/s51b_paged_ab.log
(cd /tmp/s51b_new && cp -r $ROOT/tests . && OMP_NUM_THREADS=16 timeout 300 python3 -m pytest -q -x tests/test_kvcache.py tests/test_kvcache_quant.py -p no:cacheprovider > $OUT/s51b_tests.log 2>&1; tail -n1 $OUT/s51b_tests.log)
cd /tmp/s51b_new && for a in "--dtype bf16 --kv-dtype int8" "--dtype bf16"; do PYTHONPATH=/tmp/s51b_new python3 $ROOT/bench/decode_extras.py --threads 16 $a 2>&1 | head -9; done | tee $OUT/s51b_decode_extras16.log
