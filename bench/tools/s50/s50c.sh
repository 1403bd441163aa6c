#!/bin/bash
# AMX test machine: bash bench/tools/s50/s50c.sh (logs under $OUT). The paged decode's in-block
# prefetch and near prefetch (paged_inblock.patch: 5166923 and 9d90076, in this tree) against the tree without them, in process at 16
# threads, both load orders (decode_paged_ab.py), blocks 16 / 64 / 256, float32 / bf16 / int8.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/s50c_machine.txt
bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s50/paged_inblock.patch s50c
cd /tmp
for c in fp32 bf16 int8; do for bs in 256 64 16; do
  PYTHONPATH=/tmp/s50c_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 16 $c $bs 7 /tmp/s50c_base/fa2cpu /tmp/s50c_new/fa2cpu | tail -n1
  PYTHONPATH=/tmp/s50c_new python3 $ROOT/bench/tools/s50/decode_paged_ab.py 16 $c $bs 7 /tmp/s50c_new/fa2cpu /tmp/s50c_base/fa2cpu | tail -n1
done; done 2>&1 | tee $OUT/s50c_paged_ab.log
