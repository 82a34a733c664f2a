// Read bandwidth of one thread over 256 MiB in two access patterns (docs/BENCHMARKS.md, "On AMD Zen 5"):
//   0  front to back, four 64-byte vectors per step (the tile order of packed KV pages);
//   1  blocks of 64 KiB: a 32 KiB K block read as four streams 8 KiB apart in lockstep (the link's block layout
//      as a 6-row attention tile reads it), then its 32 KiB V block front to back;
//   2  as 1, each load also prefetching (prefetcht1) DIST bytes ahead.
// Build: cc -O2 -mavx512f scripts/stream_pattern_read.c -o stream_pattern_read
// Run:   ./stream_pattern_read MODE [DIST]      (THP=1 in the environment advises huge pages)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SIZE (256ul << 20)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s MODE(0|1|2) [DIST bytes, default 65536]\n", argv[0]);
    return 2;
  }
  int mode = atoi(argv[1]);
  long dist = argc > 2 ? atol(argv[2]) : 65536;
  char *b = aligned_alloc(1 << 21, SIZE);
  if (!b) return 1;
  if (getenv("THP")) madvise(b, SIZE, MADV_HUGEPAGE);
  memset(b, 1, SIZE);
  __m512 acc[4];
  for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
  double best = 1e9;
  for (int rep = 0; rep < 7; rep++) {
    double t0 = now();
    if (mode == 0) {
      for (size_t o = 0; o < SIZE; o += 256)
        for (int j = 0; j < 4; j++) acc[j] = _mm512_add_ps(acc[j], _mm512_load_ps((float *)(b + o + 64 * j)));
    } else {
      for (size_t blk = 0; blk < SIZE; blk += 65536) {
        char *k = b + blk, *v = b + blk + 32768;
        for (int d = 0; d < 8192; d += 64)
          for (int j = 0; j < 4; j++) {
            char *p = k + j * 8192 + d;
            if (mode == 2) _mm_prefetch(p + dist, _MM_HINT_T1);
            acc[j] = _mm512_add_ps(acc[j], _mm512_load_ps((float *)p));
          }
        for (int d = 0; d < 32768; d += 64) {
          char *p = v + d;
          if (mode == 2) _mm_prefetch(p + dist, _MM_HINT_T1);
          acc[(d >> 6) & 3] = _mm512_add_ps(acc[(d >> 6) & 3], _mm512_load_ps((float *)p));
        }
      }
    }
    double t = now() - t0;
    if (t < best) best = t;
  }
  float x[16], s = 0;
  for (int i = 0; i < 4; i++) {
    _mm512_storeu_ps(x, acc[i]);
    s += x[0];
  }
  printf("mode %d dist %ld: %.1f GB/s (checksum %g)\n", mode, dist, SIZE / best / 1e9, s);
  return 0;
}
