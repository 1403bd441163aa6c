// The int8 decode route's QK group in isolation (4 keys x 4 rows x 128 features, 64 vpdpwssd):
// with the 45-operation horizontal-sum tree of DecodeGemm::sums16, without it, and with the keys
// in pairs (8 accumulators, a 21-operation tree) fed by broadcast or duplicated q rows, and (session
// 40) over a rotated q gathered as Q16DecodeGemm::sums_rotated does (rotation k holds row (b+k)%4 in
// 128-bit block b; 34 operations; its scores are checked against sums16's). Cycles per group from
// TSC ticks / 0.75 (the Zen 4 VM's measured TSC/core clock ratio; raw TSC printed beside it).
// Sessions 26 and 40, bench/RESULTS.md "int8 decode on Zen 4, where the cycles go", "Session 40".
//   g++ -O3 -march=native bench/tools/i8_qk_tree_bench.cpp -o /tmp/i8qk && /tmp/i8qk
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <x86intrin.h>
static inline __m512i dp(__m512i a, __m512i b, __m512i c){ __asm__("vpdpwssd %2,%1,%0":"+v"(a):"v"(b),"v"(c)); return a;}
static inline __m512 addi(__m512 a, __m512 b){ return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
static __m512 sums16(const __m512* v) {
    __m512 s1[8], s2[4];
    for (int j = 0; j < 8; ++j) s1[j] = addi(_mm512_unpacklo_ps(v[2*j], v[2*j+1]), _mm512_unpackhi_ps(v[2*j], v[2*j+1]));
    for (int j = 0; j < 4; ++j) { const __m512d c = _mm512_castps_pd(s1[2*j]), d = _mm512_castps_pd(s1[2*j+1]);
        s2[j] = addi(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d))); }
    auto fold = [&](__m512 x, __m512 y) { return addi(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2,0,2,0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3,1,3,1))); };
    return fold(fold(s2[0], s2[1]), fold(s2[2], s2[3]));
}
// acc[i][k]: key i, rotation k (block b holds row (b+k)%4) -> lane 4i+r = score(key i, row r):
// each key's rotations turned so that block r holds row r and added, a 4 x 4 in-block tree, a permute.
static __m512 rot16(const __m512i (&acc)[4][4]) {
    __m512 u[4];
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_add_epi32(acc[i][0], _mm512_shuffle_i32x4(acc[i][1], acc[i][1], _MM_SHUFFLE(2,1,0,3))),
                                                    _mm512_add_epi32(_mm512_shuffle_i32x4(acc[i][2], acc[i][2], _MM_SHUFFLE(1,0,3,2)),
                                                                     _mm512_shuffle_i32x4(acc[i][3], acc[i][3], _MM_SHUFFLE(0,3,2,1)))));
    const __m512 a = addi(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    const __m512 b = addi(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    const __m512 t = addi(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));  // lane 4r+i
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0,4,8,12, 1,5,9,13, 2,6,10,14, 3,7,11,15), t);
}
static __m512 sums8x2(const __m512i (&acc)[2][4]) {
    __m512 s1[4], s2[2];
    for (int k = 0; k < 4; ++k) { __m512 a=_mm512_castsi512_ps(acc[k/2][2*(k%2)]), b=_mm512_castsi512_ps(acc[k/2][2*(k%2)+1]); s1[k]=addi(_mm512_unpacklo_ps(a,b),_mm512_unpackhi_ps(a,b)); }
    for (int p = 0; p < 2; ++p) { const __m512d c=_mm512_castps_pd(s1[2*p]), d=_mm512_castps_pd(s1[2*p+1]); s2[p]=addi(_mm512_castpd_ps(_mm512_unpacklo_pd(c,d)),_mm512_castpd_ps(_mm512_unpackhi_pd(c,d))); }
    return addi(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2,0,2,0)), _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3,1,3,1)));
}
int8_t K[64*1024] __attribute__((aligned(64)));
int16_t Q[4*128] __attribute__((aligned(64)));
int16_t Q2[4*256] __attribute__((aligned(64)));
int16_t QR[4*128] __attribute__((aligned(64)));  // Q rotated: [chunk][k][32], block b = row (b+k)%4
float S0[1024*16] __attribute__((aligned(64)));  // sums16's scores, to check the rotated ones
float S[64*64*16] __attribute__((aligned(64)));
int main(int argc, char**){
  for(int i=0;i<64*1024;i++) K[i]=i*7; for(int i=0;i<512;i++) Q[i]=i; for(int i=0;i<1024;i++) Q2[i]=i;
  for(int c=0;c<4;c++) for(int k=0;k<4;k++) for(int e=0;e<32;e++) QR[c*128+k*32+e]=Q[c*128+((e/8+k)%4)*32+e];
  const int G=4096*64;
  const char* names[]={"sums16","no tree","pairs, q broadcast","pairs, q duplicated","pairs, no tree","rotated q (now)"};
  for (int mode=0; mode<6; ++mode) { double best=1e30; for(int rep=0;rep<5;rep++){
  uint64_t t0=__rdtsc();
  for(int g=0; g<G; g++){
    const int8_t* kr = K + (g%64)*4*128;
    __m512 tot;
    if (mode < 2 || mode == 5) {
    __m512i acc[4][4];
    for(int i=0;i<4;i++) for(int j=0;j<4;j++) acc[i][j]=_mm512_setzero_si512();
    const int16_t* qq = mode == 5 ? QR : Q;
    for(int d=0; d<128; d+=32){
      __m512i qv[4]; for(int j=0;j<4;j++) qv[j]=_mm512_load_si512(qq+d*4+j*32);
      for(int i=0;i<4;i++){ __m512i kv=_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(kr+i*128+d)));
        for(int j=0;j<4;j++) acc[i][j]=dp(acc[i][j],kv,qv[j]); }
    }
    if (mode==0) { __m512 v[16]; for(int i=0;i<4;i++) for(int j=0;j<4;j++) v[i*4+j]=_mm512_castsi512_ps(acc[i][j]); tot=sums16(v); }
    else if (mode==5) tot=rot16(acc);
    else { for(int i=0;i<4;i++) for(int j=0;j<4;j++) __asm__ volatile(""::"v"(acc[i][j])); tot=_mm512_castsi512_ps(acc[0][0]); }
    } else {
    __m512i acc[2][4];
    for(int i=0;i<2;i++) for(int j=0;j<4;j++) acc[i][j]=_mm512_setzero_si512();
    for(int d=0; d<128; d+=16){
      __m512i qv[4];
      for(int j=0;j<4;j++) qv[j] = mode==2 ? _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i*)(Q+(d/32)*128+j*32+d%32))) : _mm512_load_si512(Q2+d*8+j*32);
      for(int p=0;p<2;p++){ __m512i kv=_mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(kr+2*p*128+d))), _mm_loadu_si128((const __m128i*)(kr+(2*p+1)*128+d)),1));
        for(int j=0;j<4;j++) acc[p][j]=dp(acc[p][j],kv,qv[j]); }
    }
    if (mode==4) { for(int i=0;i<2;i++) for(int j=0;j<4;j++) __asm__ volatile(""::"v"(acc[i][j])); tot=_mm512_castsi512_ps(acc[0][0]); }
    else tot=sums8x2(acc);
    }
    _mm512_store_ps(S+(g%1024)*16, _mm512_cvtepi32_ps(_mm512_castps_si512(tot)));
  }
  uint64_t t1=__rdtsc(); double c=(t1-t0)/(double)G; if(c<best) best=c; }
  printf("%-24s %.1f cycles (%.1f TSC) per 4-key group (64 dp)\n", names[mode], best/0.75, best);
  if (mode==0) for(int i=0;i<1024*16;i++) S0[i]=S[i];
  if (mode==5) for(int i=0;i<1024*16;i++) if (S[i]!=S0[i]) { printf("rotated q: score %d differs from sums16's\n", i); return 1; }
  }
  printf("%f\n", S[5]);
}
