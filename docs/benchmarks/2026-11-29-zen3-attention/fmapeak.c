#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(){ __m256 a0=_mm256_set1_ps(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0; __m256 b=_mm256_set1_ps(0.9999999f), c=_mm256_set1_ps(1e-9f);
 struct timespec t0,t1; clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t0); long n=100000000;
 for(long i=0;i<n;i++){ a0=_mm256_fmadd_ps(a0,b,c);a1=_mm256_fmadd_ps(a1,b,c);a2=_mm256_fmadd_ps(a2,b,c);a3=_mm256_fmadd_ps(a3,b,c);a4=_mm256_fmadd_ps(a4,b,c);a5=_mm256_fmadd_ps(a5,b,c);a6=_mm256_fmadd_ps(a6,b,c);a7=_mm256_fmadd_ps(a7,b,c);a8=_mm256_fmadd_ps(a8,b,c);a9=_mm256_fmadd_ps(a9,b,c);}
 clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t1); double s=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)*1e-9; __m256 r=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(_mm256_add_ps(a6,a7),_mm256_add_ps(a8,a9))));
 printf("%.1f GFLOP/s (1 thread, CPU time) %f\n", n*10.0*16/s/1e9, r[0]); }
