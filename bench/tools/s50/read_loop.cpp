// Session 50: a plain read loop (64-bit integer sums, vectorized by the compiler) over SIZE_MB, THREADS threads, HUGE: madvise 2 MB pages.
//   g++ -O3 -fopenmp read_loop.cpp -o read_loop && ./read_loop THREADS HUGE SIZE_MB
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <vector>
#include <chrono>
#include <sys/mman.h>
int main(int argc,char**argv){ int nt=atoi(argv[1]); int huge=atoi(argv[2]); long nbytes=(long)atol(argv[3])<<20; long n=nbytes/8;
 uint64_t* buf=(uint64_t*)aligned_alloc(2<<20,nbytes); if(huge) madvise(buf,nbytes,MADV_HUGEPAGE);
#pragma omp parallel for num_threads(nt) schedule(static)
 for(long i=0;i<n;++i) buf[i]=i&7;
 double best=0; uint64_t sink=0;
 for(int rep=0;rep<5;++rep){ auto t0=std::chrono::steady_clock::now(); uint64_t sum=0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+:sum)
  for(long i=0;i<n;++i) sum+=buf[i];
  double el=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); sink+=sum; double g=n*8.0/el*1e-9; if(g>best)best=g; printf("%.1f ",g);}
 printf("best %.1f\n",best); return sink==1;}
