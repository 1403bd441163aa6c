#!/bin/bash
# AMX test machine: bash bench/tools/s47/s47f.sh (logs under $OUT). Builds the amx family of this
# tree (new: the AMX forward packs Q 16 rows at a time by transposes, AmxGemm::pack_q_rows) and of
# this tree with amx_pack_q_rows.patch reversed (base), then ab_inproc.py forward base vs new.
# It ran on a tree with the patch applied; the library kept the base (not faster): to run it
# again, `patch -p1 < bench/tools/s47/amx_pack_q_rows.patch` first.
cd "$(dirname "$0")/../../.."
ROOT=$PWD; HERE=$ROOT/bench/tools/s47
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
bash $HERE/build_pair.sh $HERE/amx_pack_q_rows.patch q
cd /tmp && for args in "16 32 2048 0 bf16 9" "16 32 2048 1 bf16 9" "16 32 4096 0 bf16 5" "16 32 4096 1 bf16 5" "1 4 2048 0 bf16 5" "16 32 2048 0 bf16 9"; do
  PYTHONPATH=/tmp/q_new python3 $ROOT/bench/ab_inproc.py /tmp/q_base/fa2cpu /tmp/q_new/fa2cpu $args 2>&1 | tail -n1
done | tee $OUT/pack_q_rows_ab.log
