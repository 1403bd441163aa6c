#!/bin/bash
# variant.sh DIR SRC [cflags]: a build of the tree at SRC (a checkout's working tree) in DIR/fa2cpu,
# for in-process A/Bs (bench/tools/s52/bwd_multi.py takes DIR/fa2cpu/; the package's name is DIR's
# last component). DISABLE (env) leaves families out (FA2CPU_DISABLE) to build faster.
set -e
DIR=$1; SRC=$2; CF=${3-}
rm -rf "$DIR"; mkdir -p "$DIR"
cp -r "$SRC"/setup.py "$SRC"/pyproject.toml "$SRC"/fa2cpu "$SRC"/csrc "$SRC"/README.md "$DIR"/
rm -f "$DIR"/fa2cpu/*.so "$DIR"/fa2cpu/_core.cpp
cd "$DIR" && FA2CPU_DISABLE=${DISABLE-} FA2CPU_EXTRA_CFLAGS="$CF" python setup.py build_ext --inplace -j2 > build.log 2>&1 && echo "built $DIR"
