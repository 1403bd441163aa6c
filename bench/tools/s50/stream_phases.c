// Session 50: two streams (K, V) read in alternating phases of PHASE bytes with WORK multiply-adds per 64-byte line,
// prefetched FAR bytes ahead (mode 1, prefetcht1), NEAR bytes ahead (mode 2, prefetcht0), or across streams (modes 4, 8).
//   gcc -O3 -DWORK=12 -mavx512f -mavx512bw stream_phases.c -o stream_phases && ./stream_phases SIZE_MB PHASE MODE FAR NEAR
// two streams (K, V) read in alternating phases of PH bytes, each prefetched FAR ahead (T1) and NEAR (T0) while in its phase
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t n=(size_t)atol(argv[1])<<20; long ph=atol(argv[2]); int mode=atoi(argv[3]); long far=atol(argv[4]); long near=atol(argv[5]);
  char*k=aligned_alloc(2<<20,n); madvise(k,n,MADV_HUGEPAGE); memset(k,1,n);
  char*v=aligned_alloc(2<<20,n); madvise(v,n,MADV_HUGEPAGE); memset(v,1,n);
  char*e=aligned_alloc(2<<20,n); madvise(e,n,MADV_HUGEPAGE);
  double best=1e9; __m512 acc[16]; for(int i=0;i<16;i++) acc[i]=_mm512_set1_ps(0.f);
  __m512 m=_mm512_set1_ps(1.0001f);
  for(int r=0;r<4;r++){
    memset(e,r,n);
    double t0=now();
    for(size_t t=0;t<n;t+=ph) for(int s=0;s<2;s++){ const char* base=s?v:k;
      for(size_t i=t;i<t+ph;i+=64){
        const char* p = base + i;
        if(mode&1) _mm_prefetch(p+far,_MM_HINT_T1);
        if(mode&2) _mm_prefetch(p+near,_MM_HINT_T0);
        if(mode&4) _mm_prefetch(s ? k + i + ph : v + i, _MM_HINT_T1);
        if(mode&8) _mm_prefetch(s ? k + i + ph/2 : v + i - ph/2, _MM_HINT_T1);
        __m512 x=_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
        _Pragma("GCC unroll 64") for(int w=0;w<WORK;w++) acc[w&15]=_mm512_fmadd_ps(x,m,acc[w&15]);
      }}
    double el=now()-t0; if(el<best)best=el;
  }
  float s=0; for(int i=0;i<16;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("work %d phase %ld mode %d far %ld near %ld: %.1f GB/s (%.2f ns/line) %g\n",WORK,ph,mode,far,near,2*n/best/1e9,best/(2*n/64)*1e9,s>0?1.0:0.0);
}
