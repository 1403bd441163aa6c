#!/bin/bash
# AMX test machine (session 60): issue 11's 16-thread table at HEAD (was s59d), the decode's fixed
# cost per call at 16 threads, and the avx512 family's int8 decode with and without the int16
# (AVX512-VNNI) products (FA2CPU_ISA=avx512; FA2CPU_I8_VNNI=0 keeps the float32 route).
cd "$(dirname "$0")/../../.."
. bench/tools/amx_build.sh $OUT/s60a_issue11.log
{ for t in 16 2; do for v in 1 0 1 0; do echo "== FA2CPU_ISA=avx512 FA2CPU_I8_VNNI=$v threads $t"
    FA2CPU_ISA=avx512 FA2CPU_I8_VNNI=$v PYTHONPATH=$ROOT timeout 60 python3 bench/kv_quant.py --threads $t --caches bf16,int8 --reps 15
  done; done
  echo "== amx family, Nk=16 (fixed cost per call), then the full shape"
  PYTHONPATH=$ROOT timeout 40 python3 bench/kv_quant.py --threads 16 --nk 16 --caches bf16,int8 --reps 41
  PYTHONPATH=$ROOT timeout 60 python3 bench/kv_quant.py --threads 16 --caches bf16,int8 --reps 15
  echo "decode done at $(elapsed) s"; } > $OUT/s60a_decode.log 2>&1
{ PYTHONPATH=$ROOT timeout 200 python3 bench/backward_vs_torch.py --threads 16 --heads 32 --n 4096 --dtypes fp32,bf16 --reps 3
  } >> $OUT/s60a_issue11.log 2>&1
echo "all done at $(elapsed) s" >> $OUT/s60a_issue11.log
