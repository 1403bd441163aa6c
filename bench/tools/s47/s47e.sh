#!/bin/bash
# AMX test machine: bash bench/tools/s47/s47e.sh (logs under $OUT). Builds the amx family of this
# tree (new: the AMX backward takes contiguous bf16 rows as they are, K^T by transposes) and of
# this tree with bwd_raw_bf16.patch reversed (base), then ab_inproc.py backward base vs new.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s47
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
bash $HERE/build_pair.sh $HERE/bwd_raw_bf16.patch r
cd /tmp && for args in "16 backward 16 2048 0 bf16 9" "16 backward 16 2048 1 bf16 9" "16 backward 32 4096 0 bf16 5" "16 backward 32 4096 1 bf16 5" "1 backward 4 2048 0 bf16 5"; do
  PYTHONPATH=/tmp/r_new python3 $ROOT/bench/ab_inproc.py /tmp/r_base/fa2cpu /tmp/r_new/fa2cpu $args 2>&1 | tail -n1
done | tee $OUT/raw_bf16_ab.log
