// The int8 decode route's QK group (4 keys x 4 rows x 128 features, 64 vpdpwssd) with its 16 scores
// gathered by DecodeGemm::sums16 (45 operations, 30 shuffles) and by Q16DecodeGemm::sums_rotated over
// a rotated q (rotation k holds row (b+k)%4 in 128-bit block b; 34 operations): TSC ticks per group
// and a few of the scores, which must match. Session 40, bench/RESULTS.md.
//   g++ -O3 -march=native bench/tools/i8_qk_rotated_bench.cpp -o /tmp/rot && /tmp/rot
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
// acc[i][k]: key i, rotation k (block b holds row (b+k)%4). Output lane 4i+r = score(key i, row r).
static __m512 rot16(const __m512i (&acc)[4][4]) {
    __m512 u[4];
    for (int i = 0; i < 4; ++i) {
        __m512i t = acc[i][0];
        // block r of the result takes block (r - k) % 4 of acc[i][k]... acc[i][k] block b holds row (b+k)%4, so row r sits at block (r-k)%4
        t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(acc[i][1], acc[i][1], _MM_SHUFFLE(2,1,0,3)));  // result block r = src block (r-1)%4
        t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(acc[i][2], acc[i][2], _MM_SHUFFLE(1,0,3,2)));
        t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(acc[i][3], acc[i][3], _MM_SHUFFLE(0,3,2,1)));
        u[i] = _mm512_castsi512_ps(t);
    }
    const __m512 a = addi(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));  // block r: [u0 l0+l2, u1 l0+l2, u0 l1+l3, u1 l1+l3]
    const __m512 b = addi(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    const __m512 s = addi(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));  // lane 4r+i
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0,4,8,12, 1,5,9,13, 2,6,10,14, 3,7,11,15), s);  // lane 4i+r
}
int8_t K[64*1024] __attribute__((aligned(64)));
int16_t Q[4*128] __attribute__((aligned(64)));   // natural: [chunk][row][32]
int16_t QR[4*128] __attribute__((aligned(64)));  // rotated: [chunk][k][32]: block b = row (b+k)%4, dims 8b..8b+7
float S[1024*16] __attribute__((aligned(64)));
int main(){
  for(int i=0;i<64*1024;i++) K[i]=(int8_t)(i*7+3*(i>>9));
  for(int c=0;c<4;c++) for(int r=0;r<4;r++) for(int e=0;e<32;e++) Q[c*128+r*32+e]=(int16_t)((c*32+e)*13 + r*1000 - 2000);
  for(int c=0;c<4;c++) for(int k=0;k<4;k++) for(int e=0;e<32;e++){ int b=e/8, r=(b+k)%4; QR[c*128+k*32+e]=Q[c*128+r*32+e]; }
  const int G=4096*64;
  for (int mode=0; mode<2; ++mode) { double best=1e30; for(int rep=0;rep<7;rep++){
  uint64_t t0=__rdtsc();
  for(int g=0; g<G; g++){
    const int8_t* kr = K + (g%64)*4*128;
    __m512i acc[4][4];
    for(int i=0;i<4;i++) for(int j=0;j<4;j++) acc[i][j]=_mm512_setzero_si512();
    const int16_t* qq = mode ? QR : Q;
    for(int d=0; d<128; d+=32){
      __m512i qv[4]; for(int j=0;j<4;j++) qv[j]=_mm512_load_si512(qq+d*4+j*32);
      for(int i=0;i<4;i++){ __m512i kv=_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(kr+i*128+d)));
        for(int j=0;j<4;j++) acc[i][j]=dp(acc[i][j],kv,qv[j]); }
    }
    __m512 tot;
    if (mode==0) { __m512 v[16]; for(int i=0;i<4;i++) for(int j=0;j<4;j++) v[i*4+j]=_mm512_castsi512_ps(acc[i][j]); tot=sums16(v); }
    else tot = rot16(acc);
    _mm512_store_ps(S+(g%1024)*16, _mm512_cvtepi32_ps(_mm512_castps_si512(tot)));
  }
  uint64_t t1=__rdtsc(); double c=(t1-t0)/(double)G; if(c<best) best=c; }
  printf("%s %.1f TSC per 4-key group; S[0..3]=%g %g %g %g S[21]=%g\n", mode?"rot   ":"sums16", best, S[0],S[1],S[2],S[3],S[21]);
  }
}
