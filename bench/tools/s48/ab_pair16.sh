#!/bin/bash
# bench/tools/s48/ab_pair16.sh PATCH PREFIX LOG (from the repository root, AMX test machine): this
# tree (new) against it with PATCH reversed (base), amx family (bench/tools/s47/build_pair.sh), in
# one process (bench/ab_inproc.py backward, base / new): 16 threads H=16 N=2048 and H=32 N=4096,
# bf16 and fp32, then 2 threads H=8 and 1 thread H=4 (2 and 8 key splits per kv head there).
PATCH=$1; PREFIX=$2; LOG=$3; ROOT=$PWD
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
bash bench/tools/s47/build_pair.sh "$PATCH" $PREFIX
for c in "16 backward 16 2048 0 bf16 11" "16 backward 16 2048 1 bf16 11" "16 backward 16 2048 0 fp32 7" "16 backward 16 2048 1 fp32 7" \
         "16 backward 32 4096 0 bf16 5" "16 backward 32 4096 0 fp32 3" "2 backward 8 2048 0 bf16 7" "$4"; do
  [ -n "$c" ] && (cd /tmp && PYTHONPATH=/tmp/${PREFIX}_new python3 $ROOT/bench/ab_inproc.py /tmp/${PREFIX}_base/fa2cpu /tmp/${PREFIX}_new/fa2cpu $c 2>&1 | tail -n1)
done | tee $OUT/$LOG
