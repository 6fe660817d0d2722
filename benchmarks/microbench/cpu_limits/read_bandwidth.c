// Read bandwidth for a buffer of a given size (MB), best of N passes, on OMP_NUM_THREADS threads: L2 / L3 / DRAM.
//   gcc -O2 -mavx2 -fopenmp read_bandwidth.c -o read_bandwidth && for t in 1 2; do for mb in 0.2 1.1 8 66; do
//   OMP_NUM_THREADS=$t ./read_bandwidth $mb 200; done; done
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(int argc, char **argv) {
  size_t bytes = (size_t)(atof(argv[1]) * 1e6); int reps = atoi(argv[2]);
  size_t n = bytes / 32; __m256i *buf = aligned_alloc(64, n * 32);
  for (size_t i = 0; i < n * 8; i++) ((int*)buf)[i] = i;
  double best = 1e9; long long sink = 0;
  for (int r = 0; r < reps; r++) {
    double t0 = omp_get_wtime();
#pragma omp parallel reduction(+:sink)
    {
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
      for (size_t i = 0; i < n; i += 4) {
        a0 = _mm256_xor_si256(a0, buf[i]); a1 = _mm256_xor_si256(a1, buf[i+1]);
        a2 = _mm256_xor_si256(a2, buf[i+2]); a3 = _mm256_xor_si256(a3, buf[i+3]);
      }
      a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
      sink += _mm256_extract_epi64(a0, 0);
    }
    double t = omp_get_wtime() - t0; if (t < best) best = t;
  }
  printf("%.1f MB, %d threads: %.1f GB/s (best of %d)\n", bytes / 1e6, omp_get_max_threads(), bytes / best / 1e9, reps);
  return (int)(sink & 1) * 0;
}
