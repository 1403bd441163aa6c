#!/bin/bash
# AMX test machine: bash bench/tools/s48/s48f.sh (logs under $OUT). A kv head's key splits with
# sizes falling linearly (this tree) against equal splits (bwd_split_taper.patch reversed).
cd "$(dirname "$0")/../../.."
bash bench/tools/s48/ab_pair16.sh $PWD/bench/tools/s48/bwd_split_taper.patch tp s48f.log "16 backward 64 2048 0 bf16 5"
