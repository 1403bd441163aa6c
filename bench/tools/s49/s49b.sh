#!/bin/bash
# AMX test machine, after s49a.sh on the same machine (its /tmp/s49_base and /tmp/s49_new builds;
# rebuilt if gone): the cases s49a read below 1, both orders (base / new, then new / base: a build
# loaded second ran up to 9 % apart from the same build loaded first), three rounds.
cd "$(dirname "$0")/../../.."
ROOT=$PWD
[ -f /tmp/s49_new/fa2cpu/_core*.so ] && [ -f /tmp/s49_base/fa2cpu/_core*.so ] || bash bench/tools/s47/build_pair.sh $ROOT/bench/tools/s49/hidden_values.patch s49
for round in 1 2 3; do
  for c in "16 16 2048 1 bf16 9" "16 16 2048 1 fp32 7" "16 32 4096 1 fp32 5"; do
    (cd /tmp && PYTHONPATH=/tmp/s49_new python3 $ROOT/bench/ab_inproc.py /tmp/s49_base/fa2cpu /tmp/s49_new/fa2cpu $c 2>&1 | tail -n1 | sed 's/^/base-new /')
    (cd /tmp && PYTHONPATH=/tmp/s49_new python3 $ROOT/bench/ab_inproc.py /tmp/s49_new/fa2cpu /tmp/s49_base/fa2cpu $c 2>&1 | tail -n1 | sed 's/^/new-base /')
  done
done 2>&1 | tee $OUT/s49b_ab_both_orders.log
