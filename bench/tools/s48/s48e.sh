#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48e.sh (logs under $OUT). The dq reduction of split kv
# heads by the family's reduce_row (this tree) against the driver's scalar loop
# (reduce_row_family.patch reversed).
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/ab_pair16.sh $PWD/bench/tools/s48/reduce_row_family.patch rr s48e.log "1 backward 4 2048 0 bf16 5"
