// Does the AMX tile unit run beside the AVX-512 units? A loop of 4 tile loads + 4 tdpbf16ps
// (one 2 x 2 C-tile step, C never stored) alone, a softmax-like vector chunk alone (SV vectors:
// load, subtract, degree-4 exp2, sum, bf16 pair store, as tile_loop.h's exp pass), and both
// interleaved in one instruction stream; TSC cycles per iteration. argv[1] = SV (vectors per 4
// tdpbf16ps; the AMX forward's softmax has 8 per 4 of its products), argv[2] = KB the tile
// operands cycle through (0: the same 4 tiles, L1).
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mavx512bf16 -mamx-tile \
//       -mamx-bf16 bench/tools/amx_vector_overlap.cpp -o /tmp/ov && /tmp/ov 8 0 && /tmp/ov 8 256
// Session 38, 2-core Xeon with AMX (bench/RESULTS.md): with L1 operands both ran in 71-76 cycles
// against 64-69 for the tiles alone (overlap); with operands from 256 KB / 1 MB (L2) 115-132
// against a sum of 117-133 (no overlap at all).
#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <algorithm>
struct TileConfig { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static uint16_t A[8][16*32];
static uint16_t* big;
alignas(64) static float buf[96*32];
alignas(64) static uint16_t pout[96*32];
static inline __m512 ex2(__m512 x){
  __m512 f=_mm512_reduce_ps(x,_MM_FROUND_TO_NEG_INF|_MM_FROUND_NO_EXC);
  __m512 p=_mm512_fmadd_ps(_mm512_set1_ps(0.0134f),f,_mm512_set1_ps(0.0522f));
  p=_mm512_fmadd_ps(p,f,_mm512_set1_ps(0.2412f)); p=_mm512_fmadd_ps(p,f,_mm512_set1_ps(0.693f));
  p=_mm512_fmadd_ps(p,f,_mm512_set1_ps(1.f)); return _mm512_scalef_ps(p,x);}
// softmax-like chunk: read NV vectors of scores, subtract max, exp2, sum, store bf16
template<int NV> static inline void smx(const float* s, uint16_t* p, __m512 m, __m512* sum){
  for(int v=0;v<NV;v+=2){ __m512 a=ex2(_mm512_sub_ps(_mm512_loadu_ps(s+v*16),m)); __m512 b=ex2(_mm512_sub_ps(_mm512_loadu_ps(s+v*16+16),m));
    sum[0]=_mm512_add_ps(sum[0],a); sum[1]=_mm512_add_ps(sum[1],b);
    _mm512_storeu_si512(p+v*16,(__m512i)_mm512_cvtne2ps_pbh(b,a)); }
}
int main(int argc,char**argv){
  syscall(SYS_arch_prctl,0x1023,18);
  TileConfig c; memset(&c,0,sizeof c); c.palette_id=1; for(int t=0;t<8;++t){c.rows[t]=16;c.colsb[t]=64;} _tile_loadconfig(&c);
  for(int i=0;i<8;++i) for(int j=0;j<512;++j) A[i][j]=0x3c00|(j&0x7f);
  for(int i=0;i<96*32;++i) buf[i]=(i%37)*0.01f;
  const long N=200000;
  const int SV = argc > 1 ? atoi(argv[1]) : 4;      // softmax vectors per 4 tdpbf16ps
  const long SPAN = argc > 2 ? atol(argv[2]) : 0;   // KB of tile operands (0: A, in L1)
  big = (uint16_t*)aligned_alloc(64, (SPAN + 4) * 1024 + 64);
  memset(big, 0x3c, (SPAN + 4) * 1024);
  double r[3];
  for(int mode=0;mode<3;++mode){ double best=1e30;
    for(int rep=0;rep<5;++rep){
      __m512 sum[2]={_mm512_setzero_ps(),_mm512_setzero_ps()}; __m512 m=_mm512_set1_ps(0.5f);
      _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
      uint64_t t0=__rdtsc();
      for(long i=0;i<N;++i){
        if(mode!=1){ const uint16_t* b0 = SPAN? big + ((i*4)%SPAN)*512 : A[0]; _tile_loadd(4,b0,64);_tile_loadd(5,SPAN?b0+512:A[1],64);_tile_loadd(6,SPAN?b0+1024:A[2],64);_tile_loadd(7,SPAN?b0+1536:A[3],64);
          _tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,4,7);_tile_dpbf16ps(2,5,6);_tile_dpbf16ps(3,5,7);}
        if(mode!=0){ const int off=(i*SV*16)%(96*32-SV*16); 
          for(int k=0;k<SV;k+=2) smx<2>(buf+off+k*16,pout+off+k*16,m,sum);}
      }
      double t=__rdtsc()-t0; best=std::min(best,t);
      volatile float keep=_mm512_reduce_add_ps(sum[0]); (void)keep;
    }
    r[mode]=best/N;
  }
  _tile_release();
  printf("SV=%d vectors/4tdp: tiles %.1f  vector %.1f  both %.1f TSC cycles per iter (sum %.1f, max %.1f)\n",SV,r[0],r[1],r[2],r[0]+r[1],std::max(r[0],r[1]));
}
