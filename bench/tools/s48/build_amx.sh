#!/bin/bash
# bench/tools/s48/build_amx.sh DIR [PATCH] (from the repository root, on the AMX test machine; logs
# under $OUT): copies this tree (library, bench, tests) to DIR, applies PATCH if given, and builds
# the amx family there in place (-j16). Writes $OUT/machine.txt and $OUT/build.log.
DIR=$1; PATCH=$2
lscpu | grep -E "Model name|^Model:" > $OUT/machine.txt
mkdir -p $DIR && cp -r setup.py pyproject.toml fa2cpu csrc README.md bench tests $DIR/
[ -n "$PATCH" ] && (cd $DIR && patch -p1 < "$PATCH" > $OUT/patch.log 2>&1)
(cd $DIR && FA2CPU_DISABLE=avx512bf16,avx512,avx2 python3 setup.py build_ext --inplace -j16 > $OUT/build.log 2>&1; echo "build rc=$?" >> $OUT/build.log)
tail -n1 $OUT/build.log
