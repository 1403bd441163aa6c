#!/bin/bash
# Shared start of the AMX test machine's scripts (session 60 on): source it from a script in
# bench/tools/sNN/ after `cd` to the repository root. Builds the extension in place with 16 jobs
# and writes the CPU and the build's time to the log named by its first argument.
#   . bench/tools/amx_build.sh $OUT/name.log
LOG=$1; ROOT=$PWD; T0=$(date +%s)
lscpu | grep -E "^Model:|^CPU\(s\)|^Model name" > "$LOG"
python3 setup.py build_ext --inplace -j16 > /tmp/amx_build.log 2>&1
echo "build rc=$? at $(( $(date +%s) - T0 )) s" >> "$LOG"
elapsed() { echo $(( $(date +%s) - T0 )); }
