/* The FMA ceiling of bench/bench_kernels.py --cpu-matmuls: float32 FMAs per second on `nthreads` OpenMP threads,
 * each running 12 independent chains of 512-bit (AVX512F) or 256-bit (AVX2 + FMA) vfmadd, enough to cover the
 * FMA latency on the CPUs measured (4 cycles, 2 pipes); and the same for avx512_bf16's vdpbf16ps (32 products a
 * 512-bit instruction, the ceiling of kernels/cpu_matmul.c's AVX512-BF16 level) and AVX512-VNNI's vpdpbusd (64
 * int8 products an instruction, the ceiling of its int8-activation kernels at levels 2 and 3). Built and loaded by
 * kernels.native_build like the kernel libraries; a benchmark helper only, not used by the engine. */
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define CHAINS 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"), noinline)) static float chains512(int64_t iters, float seed) {
    __m512 a[CHAINS], b = _mm512_set1_ps(1.0f - seed), c = _mm512_set1_ps(seed);
    for (int j = 0; j < CHAINS; j++) a[j] = _mm512_set1_ps(seed * (j + 1));
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) a[j] = _mm512_fmadd_ps(a[j], b, c);
    float s = 0.0f;
    for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_ps(a[j]);
    return s;
}

__attribute__((target("avx2,fma"), noinline)) static float chains256(int64_t iters, float seed) {
    __m256 a[CHAINS], b = _mm256_set1_ps(1.0f - seed), c = _mm256_set1_ps(seed);
    for (int j = 0; j < CHAINS; j++) a[j] = _mm256_set1_ps(seed * (j + 1));
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) a[j] = _mm256_fmadd_ps(a[j], b, c);
    float out[8], s = 0.0f;
    for (int j = 0; j < CHAINS; j++) {
        _mm256_storeu_ps(out, a[j]);
        for (int l = 0; l < 8; l++) s += out[l];
    }
    return s;
}

__attribute__((target("avx512f,avx512bf16"), noinline)) static float chains_bf16(int64_t iters, float seed) {
    __m512 a[CHAINS];
    __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f - seed), _mm512_set1_ps(seed));
    for (int j = 0; j < CHAINS; j++) a[j] = _mm512_set1_ps(seed * (j + 1));
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) a[j] = _mm512_dpbf16_ps(a[j], b, b);
    float s = 0.0f;
    for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_ps(a[j]);
    return s;
}

__attribute__((target("avx512f,avx512vnni"), noinline)) static float chains_vnni(int64_t iters, float seed) {
    __m512i a[CHAINS];
    const __m512i b = _mm512_set1_epi32(0x01010101);
    for (int j = 0; j < CHAINS; j++) a[j] = _mm512_set1_epi32(j + (int)(seed * 1e3f));
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) a[j] = _mm512_dpbusd_epi32(a[j], b, b);
    int32_t s = 0;
    for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_epi32(a[j]);
    return (float)s;
}

/* Operations per second of `chains` (`ops` operations a round, `iters` rounds) on each of nthreads threads, the
 * best of `repeats` runs; *sink receives the sums (so that the loops are not removed). */
static double best_rate(float (*chains)(int64_t, float), double ops, int64_t iters, int repeats, int nthreads,
                        float *sink) {
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        double t = now();
        #pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int k = 0; k < nthreads; k++) sink[k] = chains(iters, 1e-3f * (k + 1));
        t = now() - t;
        if (t < best) best = t;
    }
    return ops * (double)iters * nthreads / best;
}

/* GFLOP/s (a product and its addition counted as 2) of `iters` rounds of CHAINS vdpbf16ps on each of nthreads
 * threads, the best of `repeats` runs; 0 when the CPU has no avx512_bf16. */
double pd_bf16_dot_peak_gflops(int64_t iters, int repeats, int nthreads, float *sink) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return 0.0;
    return best_rate(chains_bf16, 2.0 * 32 * CHAINS, iters, repeats, nthreads, sink) / 1e9;
}

/* GOP/s (a product and its addition counted as 2) of `iters` rounds of CHAINS vpdpbusd on each of nthreads
 * threads, the best of `repeats` runs; 0 when the CPU has no AVX512-VNNI. */
double pd_vnni_dot_peak_gops(int64_t iters, int repeats, int nthreads, float *sink) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni")) return 0.0;
    return best_rate(chains_vnni, 2.0 * 64 * CHAINS, iters, repeats, nthreads, sink) / 1e9;
}

/* GFLOP/s (an FMA counted as 2) of `iters` rounds of CHAINS FMAs on each of nthreads threads, the best of
 * `repeats` runs, 512-bit when the CPU has AVX512F, else 256-bit; 0 when it has neither AVX512F nor AVX2 + FMA. */
double pd_fma_peak_gflops(int64_t iters, int repeats, int nthreads, float *sink) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return best_rate(chains512, 2.0 * 16 * CHAINS, iters, repeats, nthreads, sink) / 1e9;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return best_rate(chains256, 2.0 * 8 * CHAINS, iters, repeats, nthreads, sink) / 1e9;
    return 0.0;
}
#else
double pd_fma_peak_gflops(int64_t iters, int repeats, int nthreads, float *sink) {
    (void)iters; (void)repeats; (void)nthreads; (void)sink;
    return 0.0;
}

double pd_bf16_dot_peak_gflops(int64_t iters, int repeats, int nthreads, float *sink) {
    return pd_fma_peak_gflops(iters, repeats, nthreads, sink);
}

double pd_vnni_dot_peak_gops(int64_t iters, int repeats, int nthreads, float *sink) {
    (void)iters; (void)repeats; (void)nthreads; (void)sink;
    return 0.0;
}
#endif
