/* Reading memory on 4 KiB pages against 2 MiB transparent huge pages (kvstore.malloc_tuning.zeros_on_huge_pages,
 * the CPU engine's KV cache): a 512 MiB buffer read whole, then as a paged KV cache's rows of one kv head are read
 * (`row` floats every `stride`), best of 8 passes, with and without madvise(MADV_HUGEPAGE) before the first
 * touch. A benchmark helper only: gcc -O2 -o thp_read bench/thp_read.c && ./thp_read */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BYTES ((size_t)512 << 20)
#define HUGE ((size_t)2 << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx2"))) static float read_rows(const float *p, size_t n, size_t stride, size_t row) {
    __m256 a = _mm256_setzero_ps(), b = a;
    for (size_t i = 0; i + row <= n; i += stride)
        for (size_t k = 0; k < row; k += 16) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(p + i + k));
            b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + k + 8));
        }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(a, b));
    return t[0];
}

static void run(int huge, size_t stride, size_t row) {
    char *base = mmap(NULL, BYTES + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return;
    float *p = (float *)(((size_t)base + HUGE - 1) & ~(HUGE - 1));
    if (huge) madvise(p, BYTES, MADV_HUGEPAGE);
    memset(p, 0, BYTES);
    double best = 1e9;
    float s = 0.0f;
    for (int r = 0; r < 8; r++) {
        const double t = now();
        s += read_rows(p, BYTES / 4, stride, row);
        if (now() - t < best) best = now() - t;
    }
    printf("%-11s every %3zu floats, %2zu read: %6.2f ms, %5.1f GB/s of the buffer%s\n",
           huge ? "huge pages" : "4 KiB pages", stride, row, best * 1e3, BYTES / best / 1e9, s != 0.0f ? "?" : "");
    munmap(base, BYTES + HUGE);
}

int main(void) {
    for (int huge = 0; huge < 2; huge++) {
        run(huge, 16, 16);   /* the whole buffer */
        run(huge, 192, 64);  /* one kv head of three (64 floats each) a token */
    }
    return 0;
}
