// vpdpwssd and vfmadd231ps zmm throughput in TSC ticks per instruction, 10 independent chains (session 59).
// gcc -O2 -mavx512f -mavx512bw -mavx512vnni -o /tmp/vnni bench/tools/s59/vnni_fma_rate.c && /tmp/vnni
#include <immintrin.h>
#include <stdio.h>
#include <x86intrin.h>
#define R 10
int main(){
  __m512i b=_mm512_set1_epi16(3), c=_mm512_set1_epi16(5);
  __m512i a0=_mm512_set1_epi32(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0;
  long n=50000000; unsigned long long t0=__rdtsc();
  for(long k=0;k<n;k++){
    a0=_mm512_dpwssd_epi32(a0,b,c);a1=_mm512_dpwssd_epi32(a1,b,c);a2=_mm512_dpwssd_epi32(a2,b,c);a3=_mm512_dpwssd_epi32(a3,b,c);a4=_mm512_dpwssd_epi32(a4,b,c);
    a5=_mm512_dpwssd_epi32(a5,b,c);a6=_mm512_dpwssd_epi32(a6,b,c);a7=_mm512_dpwssd_epi32(a7,b,c);a8=_mm512_dpwssd_epi32(a8,b,c);a9=_mm512_dpwssd_epi32(a9,b,c);
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9));
  }
  unsigned long long t1=__rdtsc();
  __m512i s=_mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(_mm512_add_epi32(a6,a7),_mm512_add_epi32(a8,a9))));
  printf("vpdpwssd zmm: %.3f tsc/instr (%d)\n",(double)(t1-t0)/(n*10.0),_mm512_reduce_add_epi32(s));
  __m512 fb=_mm512_set1_ps(1.0001f), fc=_mm512_set1_ps(0.999f);
  __m512 f0=_mm512_set1_ps(0),f1=f0,f2=f0,f3=f0,f4=f0,f5=f0,f6=f0,f7=f0,f8=f0,f9=f0;
  t0=__rdtsc();
  for(long k=0;k<n;k++){
    f0=_mm512_fmadd_ps(fb,fc,f0);f1=_mm512_fmadd_ps(fb,fc,f1);f2=_mm512_fmadd_ps(fb,fc,f2);f3=_mm512_fmadd_ps(fb,fc,f3);f4=_mm512_fmadd_ps(fb,fc,f4);
    f5=_mm512_fmadd_ps(fb,fc,f5);f6=_mm512_fmadd_ps(fb,fc,f6);f7=_mm512_fmadd_ps(fb,fc,f7);f8=_mm512_fmadd_ps(fb,fc,f8);f9=_mm512_fmadd_ps(fb,fc,f9);
    __asm__ volatile("" : "+v"(f0),"+v"(f1),"+v"(f2),"+v"(f3),"+v"(f4),"+v"(f5),"+v"(f6),"+v"(f7),"+v"(f8),"+v"(f9));
  }
  t1=__rdtsc();
  printf("vfmadd zmm: %.3f tsc/instr (%f)\n",(double)(t1-t0)/(n*10.0),_mm512_reduce_add_ps(_mm512_add_ps(f0,f9)));
}
