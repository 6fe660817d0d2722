// The CPU's peak float32 FMA rate per thread and on all threads: 12 independent AVX2 FMA chains per thread.
//   gcc -O2 -mavx2 -mfma -fopenmp fma_peak.c -o fma_peak && OMP_NUM_THREADS=1 ./fma_peak && OMP_NUM_THREADS=2 ./fma_peak
// Prints multiply-adds a second (float lanes), the figure docs/benchmarks.md ("The ceiling") divides a step's
// weight products by.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
int main(int argc, char **argv) {
  long iters = argc > 1 ? atol(argv[1]) : 200000000L;
  double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel reduction(+:sink)
  {
    __m256 a[12]; __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
    }
    __m256 s = a[0]; for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
    float o[8]; _mm256_storeu_ps(o, s); sink += o[0];
  }
  double t = omp_get_wtime() - t0;
  int th = omp_get_max_threads();
  printf("threads %d: %.2f G FMA-lane/s total (%.2f per thread), %.3f s, sink %g\n", th,
         iters * 12.0 * 8 * th / t / 1e9, iters * 12.0 * 8 / t / 1e9, t, sink);
  return 0;
}
