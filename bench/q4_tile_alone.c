/* The AVX2 int4 tile of kernels/cpu_matmul.c (q4i_avx2_tile) timed alone: one unit's tile (two slices of 16
 * channels, K = 576, 18 KiB: in L1) against 16 blocks of 4 rows of x in turn, best of 5 runs of 200,000 calls, as
 * vpmaddubsw instructions a second (against bench/avx2_ports.c's rate alone). The kernel's file is included, so
 * the static functions are in reach. A benchmark helper only:
 *     gcc -O3 -fopenmp -o q4_tile_alone bench/q4_tile_alone.c -lm && ./q4_tile_alone */
#include <stdio.h>
#include <time.h>

#include "../kernels/cpu_matmul.c"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
#if PD_X86
    const int64_t K = 576, G = K / 32, N = 1536, blocks = 16, calls = 200000;
    const int S = 2;
    uint8_t *T = aligned_alloc(64, 4 * K * S);
    int8_t *xi = aligned_alloc(64, 4 * K * blocks);
    float *di = aligned_alloc(64, 4 * G * blocks * sizeof(float)), *si = aligned_alloc(64, 4 * G * blocks * sizeof(float));
    uint32_t *tab = aligned_alloc(64, G * N * sizeof(uint32_t));
    float *y = aligned_alloc(64, 4 * blocks * N * sizeof(float));
    if (!T || !xi || !di || !si || !tab || !y) return 1;
    srand(1);
    for (int64_t i = 0; i < 4 * K * S; i++) T[i] = rand() & 15;
    for (int64_t i = 0; i < 4 * K * blocks; i++) xi[i] = (int8_t)(rand() % 255 - 127);
    for (int64_t i = 0; i < 4 * G * blocks; i++) di[i] = 0.01f, si[i] = 0.1f;
    for (int64_t i = 0; i < G * N; i++) tab[i] = 0x3c003c00u;
    double best = 1e9;
    for (int k = 0; k < 5; k++) {
        const double t = now();
        for (int64_t c = 0; c < calls; c++)
            q4i_avx2(T, NULL, 32, 0, 0, tab, NULL, NULL, NULL, xi, di, si, K, N, S, 4 * (c % blocks), 4, y);
        if (now() - t < best) best = now() - t;
    }
    const double maddubs = (double)calls * S * 2 * 4 * (K / 4);
    printf("%.1f ns a call, %.2f G vpmaddubsw/s (%.0f GOP/s)\n", best / calls * 1e9, maddubs / best / 1e9,
           maddubs * 64 / best / 1e9);
#endif
    return 0;
}
