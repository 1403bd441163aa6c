// Throughput of single AVX-512 instructions and mixes on this core (register-only asm loops, 16
// independent accumulators; cycles from a dependent vpaddd chain, latency 1). Session 26 used it
// to find the 2-core Zen 4 VM's vpdpwssd / FMA rate (1 per cycle) and that shuffles and adds
// mixed among them issue for free (bench/RESULTS.md, "int8 decode on Zen 4, where the cycles go").
//   gcc -O2 -march=native bench/tools/vec_rates.c -o /tmp/vec_rates && /tmp/vec_rates
#include <stdio.h>
#include <x86intrin.h>
#define N 20000000L
static double t(){ return (double)__rdtsc(); }
#define R8(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7)
#define BODY(name, ninstr, text) { double t0=t(); for(long i=0;i<N;i++) __asm__ volatile(text ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","xmm16","xmm17","xmm18","xmm19","xmm20","xmm21","xmm22","xmm23","xmm24","xmm25","xmm26","xmm27","xmm28","xmm29","xmm30","xmm31"); double t1=t(); printf("%-34s %.3f cyc/instr\n", name, (t1-t0)/((double)ninstr*N)/cyc); }
int main(){
  double t0=t(); for(long i=0;i<N;i++) __asm__ volatile("vpaddd %%zmm0,%%zmm0,%%zmm0\n\tvpaddd %%zmm0,%%zmm0,%%zmm0\n\tvpaddd %%zmm0,%%zmm0,%%zmm0\n\tvpaddd %%zmm0,%%zmm0,%%zmm0":::"xmm0"); double t1=t();
  double cyc=(t1-t0)/(4.0*N);
#define A16(op) op " %%zmm30,%%zmm31,%%zmm0\n\t" op " %%zmm30,%%zmm31,%%zmm1\n\t" op " %%zmm30,%%zmm31,%%zmm2\n\t" op " %%zmm30,%%zmm31,%%zmm3\n\t" op " %%zmm30,%%zmm31,%%zmm4\n\t" op " %%zmm30,%%zmm31,%%zmm5\n\t" op " %%zmm30,%%zmm31,%%zmm6\n\t" op " %%zmm30,%%zmm31,%%zmm7\n\t" op " %%zmm30,%%zmm31,%%zmm8\n\t" op " %%zmm30,%%zmm31,%%zmm9\n\t" op " %%zmm30,%%zmm31,%%zmm10\n\t" op " %%zmm30,%%zmm31,%%zmm11\n\t" op " %%zmm30,%%zmm31,%%zmm12\n\t" op " %%zmm30,%%zmm31,%%zmm13\n\t" op " %%zmm30,%%zmm31,%%zmm14\n\t" op " %%zmm30,%%zmm31,%%zmm15\n\t"
  BODY("vpdpwssd zmm", 16, A16("vpdpwssd"))
  BODY("vfmadd231ps zmm", 16, A16("vfmadd231ps"))
  BODY("vdpbf16ps zmm", 16, A16("vdpbf16ps"))
  BODY("vpmaddwd zmm", 16, A16("vpmaddwd"))
  BODY("vpaddd zmm", 16, A16("vpaddd"))
  BODY("vunpcklps zmm", 16, A16("vunpcklps"))
  BODY("vshuff32x4 zmm", 16, A16("vshuff32x4 $0x88,"))
  BODY("vpmovsxbw zmm,ymm (x16)", 16, "vpmovsxbw %%ymm29,%%zmm16\n\tvpmovsxbw %%ymm29,%%zmm17\n\tvpmovsxbw %%ymm29,%%zmm18\n\tvpmovsxbw %%ymm29,%%zmm19\n\tvpmovsxbw %%ymm29,%%zmm20\n\tvpmovsxbw %%ymm29,%%zmm21\n\tvpmovsxbw %%ymm29,%%zmm22\n\tvpmovsxbw %%ymm29,%%zmm23\n\t" "vpmovsxbw %%ymm29,%%zmm16\n\tvpmovsxbw %%ymm29,%%zmm17\n\tvpmovsxbw %%ymm29,%%zmm18\n\tvpmovsxbw %%ymm29,%%zmm19\n\tvpmovsxbw %%ymm29,%%zmm20\n\tvpmovsxbw %%ymm29,%%zmm21\n\tvpmovsxbw %%ymm29,%%zmm22\n\tvpmovsxbw %%ymm29,%%zmm23\n\t")
  BODY("16 dp + 4 vpmovsxbw (per dp)", 16, "vpmovsxbw %%ymm29,%%zmm16\n\t" A16("vpdpwssd") "vpmovsxbw %%ymm29,%%zmm17\n\tvpmovsxbw %%ymm29,%%zmm18\n\tvpmovsxbw %%ymm29,%%zmm19\n\t")
  BODY("16 dp + 8 vpaddd (per dp)", 16, A16("vpdpwssd") "vpaddd %%zmm29,%%zmm28,%%zmm16\n\tvpaddd %%zmm29,%%zmm28,%%zmm17\n\tvpaddd %%zmm29,%%zmm28,%%zmm18\n\tvpaddd %%zmm29,%%zmm28,%%zmm19\n\tvpaddd %%zmm29,%%zmm28,%%zmm20\n\tvpaddd %%zmm29,%%zmm28,%%zmm21\n\tvpaddd %%zmm29,%%zmm28,%%zmm22\n\tvpaddd %%zmm29,%%zmm28,%%zmm23\n\t")
  BODY("16 dp + 8 vunpcklps (per dp)", 16, A16("vpdpwssd") "vunpcklps %%zmm29,%%zmm28,%%zmm16\n\tvunpcklps %%zmm29,%%zmm28,%%zmm17\n\tvunpcklps %%zmm29,%%zmm28,%%zmm18\n\tvunpcklps %%zmm29,%%zmm28,%%zmm19\n\tvunpcklps %%zmm29,%%zmm28,%%zmm20\n\tvunpcklps %%zmm29,%%zmm28,%%zmm21\n\tvunpcklps %%zmm29,%%zmm28,%%zmm22\n\tvunpcklps %%zmm29,%%zmm28,%%zmm23\n\t")
  BODY("16 fma + 8 vpaddd (per fma)", 16, A16("vfmadd231ps") "vpaddd %%zmm29,%%zmm28,%%zmm16\n\tvpaddd %%zmm29,%%zmm28,%%zmm17\n\tvpaddd %%zmm29,%%zmm28,%%zmm18\n\tvpaddd %%zmm29,%%zmm28,%%zmm19\n\tvpaddd %%zmm29,%%zmm28,%%zmm20\n\tvpaddd %%zmm29,%%zmm28,%%zmm21\n\tvpaddd %%zmm29,%%zmm28,%%zmm22\n\tvpaddd %%zmm29,%%zmm28,%%zmm23\n\t")
  printf("core GHz ~ %.2f (tsc 2.596)\n", 2.596/cyc);
}
