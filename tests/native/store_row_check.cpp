// V512::store_row against kernel.h's scalar store_row: every bf16 / fp16 output bit the same for
// random rows of 1-70 floats (NaNs with payloads, infinities, fp16 overflow and subnormal
// ranges), and nothing written outside the row. Prints "ok" and exits 0, else the first
// mismatches and exits 1. Built and run by tests/test_native.py on AVX-512 machines.
#include "kernels/common/vec_avx512.h"
#include <cstdio>
#include <cstring>
#include <random>
using namespace fa2cpu;
int main(){
  std::mt19937 g(1); long bad=0, tot=0;
  for (int it=0; it<50000; ++it){
    int n = 1 + g()%70; float src[80]; uint16_t a[80], b[80];
    for(int j=0;j<n;j++){ uint32_t u=g(); int k=g()%8; if(k==0){ float f=std::ldexp(float(int(g()%2000)-1000), int(g()%60)-40); std::memcpy(&u,&f,4);} else if(k==1){ u = (g()&0x80000000u) | (0x7f800000u + (g()%4 ? (g()&0x7fffff) : 0)); } else if(k==2){ float f = (g()%2?-1:1)*(65504.f + float(g()%40)); std::memcpy(&u,&f,4);} else if(k==3){ float f=std::ldexp(1.f+float(g()%1024)/1024.f, -(int)(g()%20)-14); std::memcpy(&u,&f,4); if(g()%2) u|=0x80000000u;} std::memcpy(&src[j],&u,4);}
    for (int dt : {int(DType::bf16), int(DType::f16)}) {
      std::memset(a,0xAB,sizeof a); std::memset(b,0xAB,sizeof b);
      store_row(a, 3, 1, src, n, DType(dt)); V512::store_row(b, 3, 1, src, n, DType(dt));
      for(int j=0;j<80;j++){ tot++; if(a[j]!=b[j]){ if(bad<10){uint32_t u; std::memcpy(&u,&src[j-3<0?0:j-3],4); printf("dt=%d j=%d n=%d src=%08x scalar=%04x vec=%04x\n",dt,j,n,u,a[j],b[j]);} bad++; } }
    }
  }
  if (bad) { printf("mismatches %ld of %ld\n", bad, tot); return 1; }
  printf("ok: %ld outputs\n", tot);
  return 0;
}
