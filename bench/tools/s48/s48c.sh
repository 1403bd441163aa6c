#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48c.sh (logs under $OUT). dq partials written with
# streaming stores (this tree) against plain stores (dq_partials_streamed.patch reversed).
# (Ran with the cases of ab_pair16.sh but its last: "2 backward 16 2048 0 bf16 5".)
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/ab_pair16.sh $PWD/bench/tools/s48/dq_partials_streamed.patch nt s48c.log "2 backward 16 2048 0 bf16 5"
