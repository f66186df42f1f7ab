/* The decode step's small ops on CPU and the KV transfer's int8 codec (kernels/cpu_ops.py builds and loads this
 * file; its docstring is the contract, kernels/reference.py the semantics). Plain C11, no torch headers, fp32
 * arithmetic throughout: results differ from the reference only in rounding order. Each entry point is compiled
 * three times (target_clones: AVX512F, AVX2 + FMA, portable) and the loader picks the best the CPU runs; the loops
 * are written in 16 independent lanes (fixed order, no -ffast-math), which the compiler vectorizes on every path.
 * The clones are the per-row / per-work-item functions, not the entry points: OpenMP outlines a parallel loop's
 * body into a function of its own, which would not inherit an entry point's target.
 *
 * Rows (tokens) and decode-attention work items (one sequence and kv head) are independent: a row's result does not
 * depend on the batch it is in or on the thread count. Work is split over `nthreads` OpenMP threads (the process's
 * libgomp: torch's own when torch is loaded) only when there is enough of it; one thread runs no parallel region.
 *
 * Tensors are passed as data pointers with their strides in elements; the last dim is always contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -DPD_NO_CLONES builds one path only, for the flags given (tests/kernels/test_cpu_ops.py checks each that way). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PD_NO_CLONES)
#define PD_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define PD_CLONES
#endif
/* Lets the vectorizer if-convert float compares (exp_fast's clamps, max); no result changes: nothing here traps. */
#pragma GCC optimize("no-trapping-math")
#define PD_INLINE static inline __attribute__((always_inline))
#define LANES 16

/* ------------------------------------------------------------------------------------------------ helpers */
PD_INLINE float bf16_to_f32(uint16_t h) { union { uint32_t u; float f; } c = {(uint32_t)h << 16}; return c.f; }

/* Round to nearest even, NaN kept quiet: c10::BFloat16's conversion. */
PD_INLINE uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if (f != f) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* GCC vector extensions: one 16-float vector, lowered to the clone's registers (one zmm, two ymm, four xmm). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Lanes l and l + 8, then l + 4, l + 2, l + 1 added: the same tree as the array loop in dot's tail case. */
PD_INLINE float hsum16(const v16f *in) {
    v16f v = *in;
    v = v + __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = v + __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = v + __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = v + __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* Element i of a float32 (bf16 0) or bfloat16 (bf16 1) array. */
PD_INLINE const void *elem(const void *p, int64_t i, const int bf16) { return (const char *)p + i * (bf16 ? 2 : 4); }

/* Elements i .. i + 15 of such an array as float32 (a bfloat16 widened in registers: exact). */
PD_INLINE v16f load16(const void *p, int64_t i, const int bf16) {
    v16f v;
    if (!bf16) {
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    v16u16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    const v16u32 w = __builtin_convertvector(h, v16u32) << 16;
    memcpy(&v, &w, sizeof v);
    return v;
}

/* The LANES partial sums of sum_i a[i] * b[i] for n % LANES == 0: lane l holds the terms i = l (mod LANES); b float32
 * or bfloat16 (bf16), the same sums either way for the same values. */
PD_INLINE v16f dot_lanes_of(const float *restrict a, const void *restrict b, int64_t n, const int bf16) {
    v16f acc = {0};
    for (int64_t i = 0; i < n; i += LANES) acc += load16(a, i, 0) * load16(b, i, bf16);
    return acc;
}

PD_INLINE v16f dot_lanes(const float *restrict a, const float *restrict b, int64_t n) {
    return dot_lanes_of(a, b, n, 0);
}

/* hsum16 of 16 vectors at once: lane j of the result is hsum16(&v[j]), bit for bit (the same pairs added at
 * each level of the tree: the lanes are only moved between vectors, by two-source shuffles). */
PD_INLINE v16f hsum16x16(const v16f *v) {
    const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f x[8], y[4], z[2];
    /* x[m]: lanes 0-7 vector 2m's l + (l + 8), lanes 8-15 vector 2m + 1's */
    #pragma GCC unroll 8
    for (int m = 0; m < 8; m++)
        x[m] = __builtin_shuffle(v[2 * m], v[2 * m + 1], lo1) + __builtin_shuffle(v[2 * m], v[2 * m + 1], hi1);
    /* y[m]: lanes 4s .. 4s + 3 vector 4m + s's l + (l + 4) */
    #pragma GCC unroll 8
    for (int m = 0; m < 4; m++)
        y[m] = __builtin_shuffle(x[2 * m], x[2 * m + 1], lo2) + __builtin_shuffle(x[2 * m], x[2 * m + 1], hi2);
    /* z[m]: lanes 2s, 2s + 1 vector 8m + s's l + (l + 2) */
    #pragma GCC unroll 8
    for (int m = 0; m < 2; m++)
        z[m] = __builtin_shuffle(y[2 * m], y[2 * m + 1], lo3) + __builtin_shuffle(y[2 * m], y[2 * m + 1], hi3);
    return __builtin_shuffle(z[0], z[1], lo4) + __builtin_shuffle(z[0], z[1], hi4);
}

/* Narrow kernels (AVX2 and the portable path): GCC keeps 16-lane vectors that the target splits in memory and moves
 * them piecewise, so these hold 8-lane ones, each lane the same sums as the 16-lane code's (bit for bit). */
PD_INLINE v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }

/* hsum16 of 8 16-lane vectors, each given as a[j] = its lanes 0-7 plus its lanes 8-15 (the tree's first level):
 * the other levels, bit for bit, by two-source shuffles. Lane i of the result is the sum of vector (0, 2, 4, 6, 1,
 * 3, 5, 7)[i], so positions passed as (0, 4, 1, 5, 2, 6, 3, 7) come out in order. */
PD_INLINE v8f hsum16x8(const v8f *a) {
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo1 = {0, 2, 8, 10, 4, 6, 12, 14}, hi1 = {1, 3, 9, 11, 5, 7, 13, 15};
    v8f x[4], y[2];
    for (int m = 0; m < 4; m++)
        x[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], lo4) + __builtin_shuffle(a[2 * m], a[2 * m + 1], hi4);
    for (int m = 0; m < 2; m++)
        y[m] = __builtin_shuffle(x[2 * m], x[2 * m + 1], lo2) + __builtin_shuffle(x[2 * m], x[2 * m + 1], hi2);
    return __builtin_shuffle(y[0], y[1], lo1) + __builtin_shuffle(y[0], y[1], hi1);
}

/* dot() of q (n floats, n % 16 == 0, narrow) against 8 rows of k, ks floats apart: lane j is row j's, bit for bit.
 * Two passes of 4 rows (8 sums and q's two registers), each row's halves added as its pass ends. */
PD_INLINE v8f dot8_narrow(const float *restrict q, const float *restrict k, int64_t ks, int64_t n) {
    v8f a[8];
    for (int half = 0; half < 2; half++) {
        v8f lo[4] = {{0}}, hi[4] = {{0}};
        for (int64_t i = 0; i < n; i += LANES) {
            const v8f qa = load8(q + i), qb = load8(q + i + 8);
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                lo[j] += qa * load8(k + (4 * half + j) * ks + i);
                hi[j] += qb * load8(k + (4 * half + j) * ks + i + 8);
            }
        }
        for (int j = 0; j < 4; j++) a[2 * j + half] = lo[j] + hi[j];  /* row 4 half + j at 2 j + half */
    }
    return hsum16x8(a);
}

/* 1 where a 16-lane vector is one register (AVX512); else the narrow code below, the same bits in 8-lane halves.
 * -DPD_NARROW takes the narrow code everywhere (tests/kernels/test_cpu_ops.py builds it so on AVX512 hosts too). */
PD_INLINE int wide16(void) {
#ifdef PD_NARROW
    return 0;
#else
    return __builtin_cpu_supports("avx512f");
#endif
}

/* sum_i a[i] * b[i] in LANES partial sums, then a fixed tree (in registers when n % 16 == 0). narrow: the partial
 * sums as two 8-lane halves (lanes 0-7, 8-15), added first as hsum16's tree does: where a 16-lane vector is two
 * registers GCC passed the sums through the stack every step (RMSNorm ran slower than torch's on AVX2). */
PD_INLINE float dot(const float *restrict a, const float *restrict b, int64_t n, const int narrow) {
    if (n % LANES == 0 && narrow) {
        v8f lo = {0}, hi = {0};
        for (int64_t i = 0; i < n; i += LANES) {
            lo += load8(a + i) * load8(b + i);
            hi += load8(a + i + 8) * load8(b + i + 8);
        }
        v8f t = lo + hi;
        t = t + __builtin_shuffle(t, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
        t = t + __builtin_shuffle(t, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
        t = t + __builtin_shuffle(t, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
        return t[0];
    }
    if (n % LANES == 0) {
        v16f acc = dot_lanes(a, b, n);
        return hsum16(&acc);
    }
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

PD_INLINE float sum_sq(const float *restrict a, int64_t n, const int narrow) { return dot(a, a, n, narrow); }

/* exp(x) without branches (Cephes' expf: range reduction by ln 2 in two parts, degree-6 polynomial, 2^n from the
 * exponent bits), within 2 ulp of expf on [-87.3, 88.7]; below that it returns 0, above it clamps at exp(88.7). */
PD_INLINE float exp_fast(float x) {
    x = x > 88.72283935546875f ? 88.72283935546875f : x;
    float zero = (float)(x >= -87.33654f);
    x = x < -87.33654f ? -87.33654f : x;
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (no floorf: it is a libm call without SSE4.1) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n as two factors: n reaches 128 at the top of the range, one past the largest float exponent */
    int32_t e = (int32_t)n;
    int32_t e1 = e >> 1, e2 = e - e1;
    union { uint32_t u; float f; } s1 = {(uint32_t)(e1 + 127) << 23}, s2 = {(uint32_t)(e2 + 127) << 23};
    return p * s1.f * s2.f * zero;
}

/* `width` cache values from row `index` (rows of D) on, as fp32: the cache itself, or converted into tmp. */
PD_INLINE const float *cache_row(const void *cache, int bf16, int64_t index, int64_t width, float *restrict tmp,
                                 int64_t D) {
    if (!bf16) return (const float *)cache + index * D;
    const uint16_t *src = (const uint16_t *)cache + index * D;
    int64_t d = 0;
    for (; d + 8 <= width; d += 8) {  /* 8 at a time (16-lane vectors went through the stack on AVX2) */
        v8u16 h;
        memcpy(&h, src + d, sizeof h);
        v8u32 w = __builtin_convertvector(h, v8u32) << 16;
        memcpy(tmp + d, &w, sizeof w);
    }
    for (; d < width; d++) tmp[d] = bf16_to_f32(src[d]);
    return tmp;
}

/* The cache lines of the row cache_row would read: blocks are scattered, so the next block's rows are fetched
 * while this block's are used (the hardware prefetcher follows one block's contiguous rows only). Into L2
 * (prefetcht1), which tracks more misses in flight than L1: a decode step's KV comes from DRAM, and with
 * prefetcht0 the fetches queue behind L1's few miss buffers (0.71-0.76x the time on a 2-core AMD EPYC Zen 4,
 * bench/bench_kernels.py --decode-attention: 32 sequences, 30 layers' caches). */
PD_INLINE void prefetch_row(const void *cache, int bf16, int64_t index, int64_t width, int64_t D) {
    const char *row = (const char *)cache + index * D * (bf16 ? 2 : 4);
    for (int64_t c = 0; c < width * (bf16 ? 2 : 4); c += 64) __builtin_prefetch(row + c, 0, 2);
}

/* The same lines fetched a few at a time between the reads of the rows in use rather than all at once: `count` rows
 * of a cache from `index` (`width` values each, Hkv * D apart), `per` lines a pf_next call. A burst of a block's
 * lines stalls on the miss buffers (the prefetches wait for free ones, and the arithmetic behind them), where the
 * same lines spread over the block's arithmetic overlap with it: the float32 decode attention at 32 sequences
 * reads 1.13-1.19x as many bytes a second (bench/bench_attention_ab.py; BENCHMARKS.md, "the decode attention's
 * prefetches"). */
struct pf_stream { const char *row; int64_t col, bytes, stride, rows, per; };

PD_INLINE struct pf_stream pf_rows(const void *cache, int bf16, int64_t index, int64_t count, int64_t Hkv,
                                   int64_t width, int64_t D, int64_t calls) {
    const int64_t es = bf16 ? 2 : 4, lines = count * ((width * es + 63) / 64);
    if (count <= 0) return (struct pf_stream){NULL, 0, 0, 0, 0, 0};
    return (struct pf_stream){(const char *)cache + index * D * es, 0, width * es, Hkv * D * es, count,
                              (lines + calls - 1) / calls};
}

PD_INLINE void pf_next(struct pf_stream *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->per && f->rows > 0; i++) {
        __builtin_prefetch(f->row + f->col, 0, 2);
        f->col += 64;
        if (f->col >= f->bytes) {
            f->col = 0;
            f->row += f->stride;
            f->rows--;
        }
    }
}

/* ------------------------------------------------------------------------------------------------ RMSNorm */
/* out[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * w. With residual (res != NULL): x[t] + res[t] is written to
 * res_out[t] first and normalized. x, res: rows of stride x_s / r_s; out, res_out: contiguous [T, H]. */
PD_CLONES
static void rms_row(const float *restrict xr, const float *restrict rr, const float *restrict w, int64_t H,
                    float eps, float *restrict o, float *restrict s) {
    if (rr) {
        for (int64_t i = 0; i < H; i++) s[i] = xr[i] + rr[i];
        xr = s;
    }
    float inv = 1.0f / sqrtf(sum_sq(xr, H, !wide16()) / (float)H + eps);
    for (int64_t i = 0; i < H; i++) o[i] = xr[i] * inv * w[i];
}

void pd_rms_norm(const float *x, int64_t x_s, const float *res, int64_t r_s, const float *w, int64_t T, int64_t H,
                 float eps, float *out, float *res_out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T * H >= 16384)
    for (int64_t t = 0; t < T; t++)
        rms_row(x + t * x_s, res ? res + t * r_s : NULL, w, H, eps, out + t * H, res ? res_out + t * H : NULL);
}

/* ------------------------------------------------------------------------------------------------ rotary */
/* NeoX / rotate_half RoPE in place on the first rot_dim dims of every head: x1 = x[:half], x2 = x[half:rot],
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, (cos, sin) = cache[pos, :half], cache[pos, half:]. q, k: token
 * stride *_s0, head stride *_s1. Returns 0, or -1 when a position is outside [0, max_position). */
PD_CLONES
static void rotate_heads(float *x, int64_t s0, int64_t s1, int64_t heads, int64_t t, const float *cs,
                            int64_t half) {
    for (int64_t h = 0; h < heads; h++) {
        float *restrict x1 = x + t * s0 + h * s1;
        float *restrict x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            float a = x1[i], b = x2[i], c = cs[i], s = cs[half + i];
            x1[i] = a * c - b * s;
            x2[i] = b * c + a * s;
        }
    }
}

int pd_rotary(const int64_t *positions, int64_t T, float *q, int64_t q_s0, int64_t q_s1, int64_t Hq, float *k,
              int64_t k_s0, int64_t k_s1, int64_t Hk, const float *cache, int64_t max_position, int64_t rot_dim,
              int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
    int64_t half = rot_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cache + positions[t] * rot_dim;
        rotate_heads(q, q_s0, q_s1, Hq, t, cs, half);
        rotate_heads(k, k_s0, k_s1, Hk, t, cs, half);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ KV write */
/* key/value [T, Hkv, D] fp32 (token stride *_s0, head stride *_s1) into the caches' slot rows ([num_slots, Hkv, D],
 * fp32 or bf16); slot -1 is skipped. Returns 0, or -1 when a slot is outside [-1, num_slots). */
PD_CLONES
static void write_row(const float *restrict src, int64_t D, void *cache, int bf16, int64_t row) {
    if (bf16) {
        uint16_t *restrict dst = (uint16_t *)cache + row;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {  /* f32_to_bf16 of 8 at a time, branch-free: a NaN lane takes the quiet form */
            v8u32 u;
            memcpy(&u, src + d, sizeof u);
            const v8u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
            const v8u32 nan = (v8u32)((u & 0x7FFFFFFFu) > 0x7F800000u);
            const v8u16 h = __builtin_convertvector((rounded & ~nan) | (quiet & nan), v8u16);
            memcpy(dst + d, &h, sizeof h);
        }
        for (; d < D; d++) dst[d] = f32_to_bf16(src[d]);
    } else {
        memcpy((float *)cache + row, src, (size_t)D * sizeof(float));
    }
}

int pd_write_kv(const float *key, int64_t k_s0, int64_t k_s1, const float *value, int64_t v_s0, int64_t v_s1,
                int64_t T, int64_t Hkv, int64_t D, void *k_cache, void *v_cache, int bf16, int64_t num_slots,
                const int64_t *slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < Hkv; h++) {
            int64_t row = (slot * Hkv + h) * D;
            write_row(key + t * k_s0 + h * k_s1, D, k_cache, bf16, row);
            write_row(value + t * v_s0 + h * v_s1, D, v_cache, bf16, row);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ int8 KV blocks */
/* kernels.reference.gather_blocks_int8_ref / scatter_blocks_int8_ref (the KV transfer's int8 codec), one pass over
 * each block and no temporaries: per block, layer, K/V and kv head h of a cache slab [block_size, Hkv, D] (fp32 or
 * bf16), scale = amax / 127 (NaN when a value is NaN, as torch.amax), inv = scale > 0 ? 1 / scale : 0, q =
 * clamp(rint(x * inv), -127, 127): the reference's bits (rint rounds half to even, as torch.round; a NaN x * inv
 * becomes 0, what torch's float-to-int8 cast gives on x86). Back: x = (float)q * scale, rounded to
 * bf16 for a bf16 cache. Block i's codes [L, 2, block_size, Hkv, D] start data_stride bytes after block i - 1's,
 * its scales [L, 2, Hkv] (fp32, any alignment) scale_stride bytes after: contiguous tensors, or the records of a
 * KV payload (kvstore.transfer). The cache is [L, 2, num_blocks, block_size, Hkv, D]; block ids are checked first
 * (-1 when one is outside [0, num_blocks), nothing written). */
PD_CLONES
static void quant_slab(const void *slab, const void *next, int bf16, int64_t S, int64_t H, int64_t D,
                       int8_t *restrict q, uint8_t *scales) {
    /* Two passes over the slab in memory order (the second from cache), the next slab (NULL: none) prefetched into
     * L2 meanwhile (slabs are far apart, and the hardware prefetcher stops at each 4 KiB page); D % LANES == 0.
     * Each head's absmax is its
     * largest |x| bit pattern: for values >= 0 the float order is the integer one (signed: the patterns are below
     * 2^31, and AVX2 compares only signed), and a NaN's pattern is above infinity's, so the max is NaN when a
     * value is (as torch.amax). */
    int32_t lanes[H][LANES];
    float inv[H];
    memset(lanes, 0, sizeof lanes);
    const int64_t row_bytes = D * (bf16 ? 2 : 4);
    for (int64_t t = 0; t < S; t++)
        for (int64_t h = 0; h < H; h++) {
            if (next)
                for (int64_t c = 0; c < row_bytes; c += 64)
                    __builtin_prefetch((const char *)next + (t * H + h) * row_bytes + c, 0, 2);
            int32_t *restrict m = lanes[h];
            for (int64_t d = 0; d < D; d += LANES) {
                const int64_t at = (t * H + h) * D + d;
                for (int j = 0; j < LANES; j++) {
                    uint32_t bits;
                    if (bf16) bits = (uint32_t)((const uint16_t *)slab)[at + j] << 16;
                    else memcpy(&bits, (const float *)slab + at + j, 4);
                    const int32_t a = (int32_t)(bits & 0x7FFFFFFFu);
                    m[j] = a > m[j] ? a : m[j];
                }
            }
        }
    for (int64_t h = 0; h < H; h++) {
        int32_t top = 0;
        for (int j = 0; j < LANES; j++) top = lanes[h][j] > top ? lanes[h][j] : top;
        float amax;
        memcpy(&amax, &top, 4);
        const float scale = amax / 127.0f;
        inv[h] = scale > 0.0f ? 1.0f / scale : 0.0f;
        memcpy(scales + 4 * h, &scale, 4);
    }
    for (int64_t t = 0; t < S; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t row = (t * H + h) * D;
            const float s = inv[h];
            for (int64_t d = 0; d < D; d++) {
                const float x = bf16 ? bf16_to_f32(((const uint16_t *)slab)[row + d]) : ((const float *)slab)[row + d];
                float r = rintf(x * s);
                r = r != r ? 0.0f : r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
                q[row + d] = (int8_t)(int32_t)r;
            }
        }
}

PD_CLONES
static void dequant_slab(const int8_t *restrict q, const uint8_t *scales, int64_t S, int64_t H, int64_t D, void *slab,
                         int bf16) {
    for (int64_t t = 0; t < S; t++)
        for (int64_t h = 0; h < H; h++) {
            float scale;
            memcpy(&scale, scales + 4 * h, 4);
            const int64_t row = (t * H + h) * D;
            if (bf16) {
                uint16_t *restrict dst = (uint16_t *)slab + row;
                for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16((float)q[row + d] * scale);
            } else {
                float *restrict dst = (float *)slab + row;
                for (int64_t d = 0; d < D; d++) dst[d] = (float)q[row + d] * scale;
            }
        }
}

static int blocks_ok(const int64_t *ids, int64_t n, int64_t num_blocks) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_blocks) return 0;
    return 1;
}

int pd_gather_blocks_int8(const void *cache, int bf16, int64_t L, int64_t num_blocks, int64_t S, int64_t H, int64_t D,
                          const int64_t *ids, int64_t n, int8_t *data, int64_t data_stride, uint8_t *scales,
                          int64_t scale_stride, int nthreads) {
    if (!blocks_ok(ids, n, num_blocks)) return -1;
    const int64_t slab = S * H * D, esize = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n * L >= 16)
    for (int64_t u = 0; u < n * L * 2; u++) {
        const int64_t i = u / (2 * L), lk = u % (2 * L);  /* lk = 2 l + (0 K, 1 V) */
        const int64_t v = u + 1 < n * L * 2 ? u + 1 : u, lk1 = v % (2 * L), id1 = ids[v / (2 * L)];
        quant_slab((const char *)cache + ((lk * num_blocks + ids[i]) * slab) * esize,
                   v != u ? (const char *)cache + ((lk1 * num_blocks + id1) * slab) * esize : NULL, bf16, S, H, D,
                   (int8_t *)((char *)data + i * data_stride) + lk * slab, scales + i * scale_stride + 4 * H * lk);
    }
    return 0;
}

int pd_scatter_blocks_int8(const int8_t *data, int64_t data_stride, const uint8_t *scales, int64_t scale_stride,
                           void *cache, int bf16, int64_t L, int64_t num_blocks, int64_t S, int64_t H, int64_t D,
                           const int64_t *ids, int64_t n, int nthreads) {
    if (!blocks_ok(ids, n, num_blocks)) return -1;
    const int64_t slab = S * H * D, esize = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n * L >= 16)
    for (int64_t u = 0; u < n * L * 2; u++) {
        const int64_t i = u / (2 * L), lk = u % (2 * L);
        dequant_slab((const int8_t *)((const char *)data + i * data_stride) + lk * slab,
                     scales + i * scale_stride + 4 * H * lk, S, H, D,
                     (char *)cache + ((lk * num_blocks + ids[i]) * slab) * esize, bf16);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ SiLU * up */
/* out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + exp(-g)); gu rows of stride gu_s, out [T, I]. */
PD_CLONES
static void silu_row(const float *restrict g, const float *restrict u, int64_t I, float *restrict o) {
    for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_fast(-g[i])) * u[i];
}

void pd_silu_mul(const float *gu, int64_t gu_s, int64_t T, int64_t I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T * I >= 16384)
    for (int64_t t = 0; t < T; t++) silu_row(gu + t * gu_s, gu + t * gu_s + I, I, out + t * I);
}

/* ------------------------------------------------------------------------------------------------ top k */
/* The indices of the k largest values of each row of x [M, N] (rows `stride` floats apart) to out [M, k], in no
 * order: an LM head's candidates (engine.quant). One pass a row: the k best so far and the smallest of them, and
 * only a value above that smallest is looked at twice (a run of 16 is first tested as a whole). Of equal values
 * the earliest index wins; NaN never does. Returns the number of rows with fewer than k values above -inf (their
 * out rows are not filled: the caller takes another way). */
#define TOPK_MAX 64
#define TOPK_RUN 16

static int top_k_row(const float *row, int64_t n, int64_t k, int64_t *out) {
    float best[TOPK_MAX];
    int64_t at[TOPK_MAX];
    for (int64_t j = 0; j < k; j++) best[j] = -INFINITY, at[j] = -1;
    float floor_value = -INFINITY;  /* the smallest of best[] */
    int64_t floor_slot = 0;
    for (int64_t base = 0; base < n; base += TOPK_RUN) {
        const int64_t end = base + TOPK_RUN < n ? base + TOPK_RUN : n;
        int any = 0;
        for (int64_t i = base; i < end; i++) any |= row[i] > floor_value;
        if (!any) continue;
        for (int64_t i = base; i < end; i++) {
            if (!(row[i] > floor_value)) continue;
            best[floor_slot] = row[i], at[floor_slot] = i;
            floor_slot = 0;  /* the new smallest; of equals the latest slot, so a later index leaves first */
            for (int64_t j = 1; j < k; j++)
                if (best[j] < best[floor_slot] || (best[j] == best[floor_slot] && at[j] > at[floor_slot]))
                    floor_slot = j;
            floor_value = best[floor_slot];
        }
    }
    for (int64_t j = 0; j < k; j++) {
        if (at[j] < 0) return 1;
        out[j] = at[j];
    }
    return 0;
}

int pd_top_k_rows(const float *x, int64_t M, int64_t N, int64_t stride, int64_t k, int64_t *out, int nthreads) {
    if (k < 1 || k > TOPK_MAX || k > N) return -1;
    int short_rows = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads) reduction(+ : short_rows) \
        if (nthreads > 1 && M * N >= 65536)
    for (int64_t m = 0; m < M; m++) short_rows += top_k_row(x + m * stride, N, k, out + m * k);
    return short_rows;
}

/* out[m][n] <- (sum_i w[n][i] x[m][i]) * scale[n] + bias[n] for each n = ids[m][j], j < k: an int8 LM head's top
 * candidates recomputed in float32 from its int8 weights (engine.quant.Int8Linear.logits), each row on its own.
 * w [N][K] int8 and x [M][K] float32 contiguous, ids [M][k], out rows `out_stride` floats apart, bias NULL or [N].
 * Returns 0; -1 (nothing written) when an id is outside [0, N). */
PD_CLONES static void recompute_row(const float *restrict x, int64_t K, const int8_t *restrict w,
                                    const float *restrict scale, const float *restrict bias,
                                    const int64_t *restrict ids, int64_t k, float *restrict out) {
    for (int64_t j = 0; j < k; j++) {
        const int8_t *restrict row = w + ids[j] * K;
        float acc[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= K; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += (float)row[i + l] * x[i + l];
        for (int l = 0; i < K; i++, l++) acc[l] += (float)row[i] * x[i];
        for (int h = LANES / 2; h > 0; h /= 2)
            for (int l = 0; l < h; l++) acc[l] += acc[l + h];
        out[ids[j]] = acc[0] * scale[ids[j]] + (bias ? bias[ids[j]] : 0.0f);
    }
}

int pd_recompute_logits_int8(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale,
                             const float *bias, int64_t N, const int64_t *ids, int64_t k, float *out,
                             int64_t out_stride, int nthreads) {
    for (int64_t t = 0; t < M * k; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && M * k * K >= 65536)
    for (int64_t m = 0; m < M; m++) recompute_row(x + m * K, K, w, scale, bias, ids + m * k, k, out + m * out_stride);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ attention */
/* Fewer (position, kv head) pairs than this run on one thread: ~20 ns each, less than waking a second thread on a
 * loaded host (measured at batch 1: a 128-token context took 20 us on one thread, 90 us on two). From here two
 * threads pay on a quiet one (2-core Zen 4, bench/bench_attention_ab.py: 0.58-0.85x the time of one thread between
 * 1024 and 8192 pairs at 1-4 sequences, prompts of 16-32 tokens 0.68-1.0x, in the decode step's own region). */
#define PARALLEL_WORK 1024

/* The thread-local scratch of one work item (scores, a converted row, the output accumulator): grown, never
 * shrunk. */
static __thread float *scratch = NULL;
static __thread size_t scratch_floats = 0;

static float *get_scratch(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

struct attn {
    const float *q; int64_t q_s0, q_s1, Hq, D;
    const void *k_cache, *v_cache; int bf16; int64_t num_blocks, block_size, Hkv;
    const int32_t *tables; int64_t table_s0; const int32_t *seq_lens;
    float scale, softcap; int64_t window;
    float *out;
    const int32_t *starts;  /* query_start_loc: sequence b's new tokens are query rows starts[b] .. starts[b + 1] - 1 */
};

/* The first position sequence b's new token sees: its window's start, 0 without one. */
PD_INLINE int64_t first_visible(const struct attn *a, int64_t b) {
    const int64_t len = a->seq_lens[b];
    return a->window > 0 && len > a->window ? len - a->window : 0;
}

/* The scaled score of one query row against one key row (softcap 0: none). */
PD_INLINE float score(const float *restrict q, const float *restrict k, int64_t D, float scale, float softcap,
                      const int narrow) {
    float s = dot(q, k, D, narrow) * scale;
    return softcap > 0.0f ? tanhf(s / softcap) * softcap : s;
}

PD_INLINE v8f max8(v8f a, v8f b) {  /* a > b ? a : b lane by lane */
    const v8i m = a > b;
    return (v8f)(((v8i)a & m) | ((v8i)b & ~m));
}

/* x[l] <- exp_fast(x[l] - m) for 16 lanes, added to the partial sums lo (lanes 0-7) and hi (8-15). */
PD_INLINE void exp16(float *restrict x, float m, v8f *lo, v8f *hi) {
    for (int l = 0; l < LANES; l++) x[l] = exp_fast(x[l] - m);
    *lo += load8(x);
    *hi += load8(x + 8);
}

/* s[0 .. n) <- softmax(s) in place: max, exp and sum in LANES partials by index (s[i] in lane i % LANES), then
 * hsum16's tree of the sums. The last n % LANES scores go through the same vector code, padded with -inf (exp 0:
 * a partial sum plus 0 keeps its bits). */
PD_INLINE void softmax_row(float *restrict s, int64_t n) {
    const int64_t body = n / LANES * LANES, rest = n - body;
    float tail[LANES];
    for (int l = 0; l < LANES; l++) tail[l] = l < rest ? s[body + l] : -INFINITY;
    const v8f ninf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    v8f lo = ninf, hi = ninf;
    for (int64_t i = 0; i < body; i += LANES) {
        lo = max8(load8(s + i), lo);
        hi = max8(load8(s + i + 8), hi);
    }
    if (rest) {
        lo = max8(load8(tail), lo);
        hi = max8(load8(tail + 8), hi);
    }
    v8f mv = max8(hi, lo);
    mv = max8(__builtin_shuffle(mv, (v8i){4, 5, 6, 7, 0, 1, 2, 3}), mv);
    mv = max8(__builtin_shuffle(mv, (v8i){2, 3, 0, 1, 6, 7, 4, 5}), mv);
    mv = max8(__builtin_shuffle(mv, (v8i){1, 0, 3, 2, 5, 4, 7, 6}), mv);
    const float m = mv[0];
    v8f sl = {0}, sh = {0};
    for (int64_t i = 0; i < body; i += LANES) exp16(s + i, m, &sl, &sh);
    if (rest) {
        exp16(tail, m, &sl, &sh);
        memcpy(s + body, tail, (size_t)rest * sizeof(float));
    }
    v8f t = sl + sh;  /* hsum16's tree: lanes l + (l + 8), then + 4, + 2, + 1 */
    t = t + __builtin_shuffle(t, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
    t = t + __builtin_shuffle(t, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
    t = t + __builtin_shuffle(t, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    const float inv = 1.0f / t[0];
    for (int64_t i = 0; i < n; i++) s[i] *= inv;
}

/* o[0 .. D) += w * v[0 .. D): a row's share of one position in PV. */
PD_INLINE void axpy(float *restrict o, float w, const float *restrict v, int64_t D) {
    for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
}

/* out[g] (+)= sum over positions p of w[g * w_stride + p] * v[p * vs + c ..] for NG <= 3 rows and the 32 columns
 * from c, in position order (axpy's arithmetic, bit for bit) from zero (from_zero) or from out's values: 12 sums
 * in registers of 8 lanes, each V vector loaded once for the rows (one row and 64 columns a pass loaded it once a
 * row, and axpy's sums went through memory every position). Rows of out are D apart. */
PD_INLINE void pv_rows_narrow(const int NG, const float *w, int64_t w_stride, const float *restrict v, int64_t vs,
                              int64_t n, const int64_t D, const int64_t c, const int from_zero, float *out) {
    v8f acc[3][4] = {{{0}}};
    if (!from_zero)
        for (int g = 0; g < NG; g++) memcpy(acc[g], out + g * D + c, sizeof acc[g]);
    for (int64_t p = 0; p < n; p++) {
        v8f x[4];
        #pragma GCC unroll 4
        for (int m = 0; m < 4; m++) x[m] = load8(v + p * vs + c + 8 * m);
        #pragma GCC unroll 3
        for (int g = 0; g < NG; g++) {
            const float wv = w[g * w_stride + p];  /* vector * scalar: one broadcast */
            #pragma GCC unroll 4
            for (int m = 0; m < 4; m++) acc[g][m] += wv * x[m];
        }
    }
    for (int g = 0; g < NG; g++) memcpy(out + g * D + c, acc[g], sizeof acc[g]);
}

/* pv_rows_narrow for rows g .. min(g + 3, G) - 1 of the G (out and w at row g), columns c .. c + 31. */
PD_INLINE void pv_group_narrow(int64_t G, int64_t g, const float *w, int64_t w_stride, const float *restrict v,
                               int64_t vs, int64_t n, const int64_t D, const int64_t c, const int from_zero,
                               float *out) {
    if (G - g >= 3) pv_rows_narrow(3, w, w_stride, v, vs, n, D, c, from_zero, out);
    else if (G - g == 2) pv_rows_narrow(2, w, w_stride, v, vs, n, D, c, from_zero, out);
    else pv_rows_narrow(1, w, w_stride, v, vs, n, D, c, from_zero, out);
}

/* Rows index, index + Hkv, .. of a cache (cnt positions of a block, `width` values each from the row's start) as
 * fp32: the cache itself (*stride = Hkv * D), or converted into tmp (*stride = width). */
PD_INLINE const float *block_rows(const void *cache, int bf16, int64_t index, int64_t cnt, int64_t Hkv, int64_t width,
                                  const int64_t D, float *restrict tmp, int64_t *stride) {
    if (!bf16) {
        *stride = Hkv * D;
        return (const float *)cache + index * D;
    }
    for (int64_t j = 0; j < cnt; j++) cache_row(cache, 1, index + j * Hkv, width, tmp + j * width, D);
    *stride = width;
    return tmp;
}

/* The G query rows of one position against positions p .. p + 15 of k (rows ks values apart, float32 or bfloat16
 * when bf16, wide only; f: lines fetched a position at a time): score() of each, bit
 * for bit (dot_lanes and hsum16x16 are dot's arithmetic), 16 scores at a time. s[r * stride + j] <- row r, position j.
 * narrow: 8 positions at a time in two passes of 4 (dot8_narrow: their partial sums fit 16 registers of 8 lanes,
 * where 16 positions' spilled on AVX2), reduced by hsum16x8 (hsum16x16's lanes, bit for bit). */
PD_INLINE void scores16(const float *q, int64_t q_s1, int64_t G, const void *restrict k, int64_t ks, int64_t D,
                        float scale, float softcap, float *s, int64_t stride, const int narrow, struct pf_stream *f,
                        const int bf16) {
    for (int64_t g = 0; g < G; g++) {
        if (narrow) {  /* each 8 scores stored as they come (a 16-lane vector built lane by lane went to the stack) */
            float *o = s + g * stride;
            for (int j0 = 0; j0 < 16; j0 += 8) {
                const v8f sums = dot8_narrow(q + g * q_s1, (const float *)k + j0 * ks, ks, D) * scale;
                memcpy(o + j0, &sums, sizeof sums);
            }
            if (softcap > 0.0f)
                for (int j = 0; j < 16; j++) o[j] = tanhf(o[j] / softcap) * softcap;
            continue;
        }
        v16f part[16];
        #pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            pf_next(f);
            part[j] = dot_lanes_of(q + g * q_s1, elem(k, j * ks, bf16), D, bf16);
        }
        v16f out = hsum16x16(part) * scale;
        if (softcap > 0.0f)
            for (int j = 0; j < 16; j++) out[j] = tanhf(out[j] / softcap) * softcap;
        memcpy(s + g * stride, &out, sizeof out);
    }
}

/* out[r] (+)= sum over positions p < n of w[r * w_stride + p] * v[p * vs ..] for NR <= 4 rows and `cols` columns (a
 * multiple of 16, at most 128), in position order (axpy's arithmetic, bit for bit) from zero (from_zero) or from
 * out's values, the sums in registers: v rows vs floats apart, rows of out D apart. f (or NULL): lines fetched
 * a position at a time. */
PD_INLINE void pv_rows(const int NR, const float *w, int64_t w_stride, const void *restrict v, int64_t vs, int64_t n,
                       const int64_t cols, int64_t D, const int from_zero, float *out, struct pf_stream *f,
                       const int bf16) {
    v16f acc[4][8];  /* NR <= 4 rows, cols <= 128; only those used are set (all of it was a 2 KiB store a call) */
    for (int r = 0; r < NR; r++)
        for (int64_t c = 0; c < cols / 16; c++) {
            if (from_zero) acc[r][c] = (v16f){0};
            else memcpy(&acc[r][c], out + r * D + 16 * c, sizeof acc[r][c]);
        }
    for (int64_t p = 0; p < n; p++) {
        pf_next(f);
        for (int64_t c = 0; c < cols / 16; c++) {
            const v16f x = load16(v, p * vs + c * 16, bf16);
            for (int r = 0; r < NR; r++) acc[r][c] += w[r * w_stride + p] * x;
        }
    }
    for (int r = 0; r < NR; r++) memcpy(out + r * D, acc[r], (size_t)cols * sizeof(float));
}

/* pv_rows for all G rows, four at a time (w and out at row 0). */
PD_INLINE void pv_all_rows(int64_t G, const float *w, int64_t w_stride, const void *restrict v, int64_t vs, int64_t n,
                           const int64_t cols, int64_t D, const int from_zero, float *out, struct pf_stream *f,
                           const int bf16) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4)
        pv_rows(4, w + g * w_stride, w_stride, v, vs, n, cols, D, from_zero, out + g * D, f, bf16);
    if (G - g == 3) pv_rows(3, w + g * w_stride, w_stride, v, vs, n, cols, D, from_zero, out + g * D, f, bf16);
    if (G - g == 2) pv_rows(2, w + g * w_stride, w_stride, v, vs, n, cols, D, from_zero, out + g * D, f, bf16);
    if (G - g == 1) pv_rows(1, w + g * w_stride, w_stride, v, vs, n, cols, D, from_zero, out + g * D, f, bf16);
}

/* The scores of `rows` query rows (from qr, a->q_s1 apart) against cnt positions whose K rows are kv, ks values
 * apart (float32, or bfloat16 when bf16: the wide path only): s[g * n + j] for row g, position j, score()'s bits:
 * 16 positions reduced together (wide, D % 16 == 0) or 8 (narrow, D % 32 == 0), the rest one at a time; f (or
 * NULL): lines fetched a position's score at a time. */
PD_INLINE void head_scores(const struct attn *a, const float *qr, const void *restrict kv, int64_t ks, int64_t cnt,
                           int64_t rows, const int64_t D, const int narrow, float *s, int64_t n, struct pf_stream *f,
                           const int bf16) {
    if (!narrow && D % 16 == 0) {
        int64_t j = 0;
        for (; j + 16 <= cnt; j += 16)
            scores16(qr, a->q_s1, rows, elem(kv, j * ks, bf16), ks, D, a->scale, a->softcap, s + j, n, 0, f, bf16);
        for (; j < cnt; j++) {
            float row[128];  /* a bfloat16 row widened (D <= 128 where bf16 is set) */
            const float *kj = cache_row(elem(kv, j * ks, bf16), bf16, 0, D, row, D);
            for (int64_t g = 0; g < rows; g++) s[g * n + j] = score(qr + g * a->q_s1, kj, D, a->scale, a->softcap, 0);
        }
        return;
    }
    const float *kr = kv;  /* float32 rows below */
    for (int64_t g = 0; g < rows; g++) {
        const float *q = qr + g * a->q_s1;
        float *sr = s + g * n;
        int64_t j = 0;
        if (narrow && D % 32 == 0)
            for (; j + 8 <= cnt; j += 8) {
                const v8f sums = dot8_narrow(q, kr + j * ks, ks, D) * a->scale;
                memcpy(sr + j, &sums, sizeof sums);
                if (a->softcap > 0.0f)
                    for (int64_t i = j; i < j + 8; i++) sr[i] = tanhf(sr[i] / a->softcap) * a->softcap;
            }
        for (; j < cnt; j++) sr[j] = score(q, kr + j * ks, D, a->scale, a->softcap, narrow);
    }
}

/* Sequence b, kv heads h0 .. h1 - 1, each with its G = Hq / Hkv query heads, against positions first .. len - 1:
 * scores, max, exp, sum and PV, each in position order, a block's positions at a time. A position's K (V) rows of
 * all kv heads are one contiguous slot row, read once for all the item's heads; each head's arithmetic is the same
 * whatever h0 and h1, so the split into items changes no bit. The next block's rows are prefetched while this
 * block's are used (a few lines a position where the rows are read in place, else in bursts spread over the item's
 * query rows or heads). kbf16 (a constant): the cache is bfloat16, read in place on the wide path, each row widened
 * in registers; otherwise a bfloat16 block is first converted (block_rows). Narrow with D % 32 == 0: scores 8
 * positions a pass (dot8_narrow) and PV's sums in registers over a block (pv_group_narrow). Wide (AVX512) with
 * D % 16 == 0: the prefill's own blocking, 16 positions' scores reduced together (scores16) and PV's sums in
 * registers over a block (pv_rows; 0.8x the time of a score and an axpy through memory per position at batch 1).
 * The same bits either way: the tests hold decode and prefill rows equal. Returns 0; -1 a block id outside
 * [0, num_blocks); -2 out of memory. */
PD_INLINE int attend_body(const struct attn *a, int64_t b, int64_t h0, int64_t h1, const int64_t D,
                          const int narrow, const int kbf16) {
    const int64_t Hkv = a->Hkv, G = a->Hq / Hkv, bs = a->block_size, len = a->seq_lens[b];
    const int64_t first = first_visible(a, b), n = len - first, rows = (h1 - h0) * G;  /* query heads of the item */
    const int64_t row_width = (h1 - h0) * D;  /* the item's part of a slot row */
    const int blocked = narrow && D % 32 == 0;
    const int wide_blocks = !narrow && D % 16 == 0 && D <= 128;
    /* direct: the wide path reads the cache's rows where they lie (kbf16: a bfloat16 cache, each row widened in
     * registers), the next block's lines spread over this block's reads (pf_stream); else block_rows gives float32
     * rows (a bfloat16 block converted as it begins, which the bursts of prefetch_row serve better) */
    const int direct = kbf16 || (wide_blocks && !a->bf16);
    float *scores = get_scratch((size_t)(rows * n + bs * row_width + rows * D));
    if (!scores) return -2;
    float *tmp = scores + rows * n, *acc = tmp + bs * row_width;
    const int32_t *table = a->tables + b * a->table_s0;
    const float *qb = a->q + b * a->q_s0 + h0 * G * a->q_s1;
    const int32_t first_block = table[first / bs];  /* nothing fetched it ahead: both its K and V rows now */
    if (first_block >= 0 && first_block < a->num_blocks)
        for (int64_t p = first; p < len && (p == first || p % bs); p++) {
            prefetch_row(a->k_cache, a->bf16, (first_block * bs + p % bs) * Hkv + h0, row_width, D);
            prefetch_row(a->v_cache, a->bf16, (first_block * bs + p % bs) * Hkv + h0, row_width, D);
        }
    for (int64_t blk = first / bs, p = first; p < len; blk++) {
        const int32_t block = table[blk];
        if (block < 0 || block >= a->num_blocks) return -1;
        const int32_t next = (blk + 1) * bs < len ? table[blk + 1] : -1;
        const int64_t off = p - blk * bs, cnt = bs - off < len - p ? bs - off : len - p;
        int64_t ks = Hkv * D;
        const void *kb = direct ? elem(a->k_cache, ((block * bs + off) * Hkv + h0) * D, kbf16)
                                : block_rows(a->k_cache, a->bf16, (block * bs + off) * Hkv + h0, cnt, Hkv, row_width, D,
                                             tmp, &ks);
        /* the next block's rows prefetched: a position's score at a time (direct), else in a burst a chunk of the
         * item's rows (narrow) or heads */
        const int64_t per = narrow ? 1 : G, chunks = rows / per;
        const int next_ok = next >= 0 && next < a->num_blocks;
        const int64_t next_rows = len - (blk + 1) * bs < bs ? len - (blk + 1) * bs : bs;
        struct pf_stream fs = pf_rows(a->k_cache, a->bf16, next * bs * Hkv + h0, direct && next_ok ? next_rows : 0,
                                      Hkv, row_width, D, rows * 16);
        for (int64_t c = 0; c < chunks; c++) {
            if (!direct && next_ok)
                for (int64_t j = c * cnt / chunks; j < (c + 1) * cnt / chunks; j++)
                    prefetch_row(a->k_cache, a->bf16, (next * bs + off + j) * Hkv + h0, row_width, D);
            head_scores(a, qb + c * per * a->q_s1, elem(kb, c * per / G * D, kbf16), ks, cnt, per, D, narrow,
                        scores + c * per * n + p - first, n, &fs, kbf16);
        }
        fs.per = INT64_MAX;  /* what a short block left */
        pf_next(&fs);
        p += cnt;
    }
    for (int64_t r = 0; r < rows; r++) softmax_row(scores + r * n, n);
    memset(acc, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t blk = first / bs, p = first; p < len; blk++) {
        const int32_t block = table[blk];  /* checked above */
        const int32_t next = (blk + 1) * bs < len ? table[blk + 1] : -1;
        const int64_t off = p - blk * bs, cnt = bs - off < len - p ? bs - off : len - p;
        int64_t vs = Hkv * D;
        const void *vb = direct ? elem(a->v_cache, ((block * bs + off) * Hkv + h0) * D, kbf16)
                                : block_rows(a->v_cache, a->bf16, (block * bs + off) * Hkv + h0, cnt, Hkv, row_width, D,
                                             tmp, &vs);
        /* parts: (kv head, 32 columns) when blocked, else kv heads; the next block's rows a position at a time
         * (direct), else in a burst a part */
        const int64_t per_head = blocked ? D / 32 : 1, parts = (h1 - h0) * per_head;
        const int64_t next_rows = len - (blk + 1) * bs < bs ? len - (blk + 1) * bs : bs;
        struct pf_stream fv = pf_rows(a->v_cache, a->bf16, next * bs * Hkv + h0, direct && next >= 0 ? next_rows : 0,
                                      Hkv, row_width, D, parts * cnt);
        for (int64_t part = 0; part < parts; part++) {
            if (!direct && next >= 0)
                for (int64_t j = part * cnt / parts; j < (part + 1) * cnt / parts; j++)
                    prefetch_row(a->v_cache, a->bf16, (next * bs + off + j) * Hkv + h0, row_width, D);
            const int64_t h = part / per_head;
            const float *w = scores + h * G * n + p - first;
            const void *vh = elem(vb, h * D, kbf16);
            if (blocked) {
                for (int64_t g = 0; g < G; g += 3)
                    pv_group_narrow(G, g, w + g * n, n, vh, vs, cnt, D, part % per_head * 32, 0, acc + (h * G + g) * D);
                continue;
            }
            if (wide_blocks) {
                pv_all_rows(G, w, n, vh, vs, cnt, D, D, 0, acc + h * G * D, &fv, kbf16);
                continue;
            }
            for (int64_t j = 0; j < cnt; j++)
                for (int64_t g = 0; g < G; g++)
                    axpy(acc + (h * G + g) * D, w[g * n + j], (const float *)vh + j * vs, D);
        }
        fv.per = INT64_MAX;
        pf_next(&fv);
        p += cnt;
    }
    for (int64_t r = 0; r < rows; r++)
        memcpy(a->out + (b * a->Hq + h0 * G + r) * D, acc + r * D, (size_t)D * sizeof(float));
    return 0;
}

/* attend_body with the common head dims as compile-time constants (unrolled dot products). */
PD_CLONES
static int attend_item(const struct attn *a, int64_t b, int64_t h0, int64_t h1) {
    const int narrow = !wide16();
    if (!narrow && a->bf16 && a->D == 64) return attend_body(a, b, h0, h1, 64, 0, 1);
    if (!narrow && a->bf16 && a->D == 128) return attend_body(a, b, h0, h1, 128, 0, 1);
    if (a->D == 64) return attend_body(a, b, h0, h1, 64, narrow, 0);
    if (a->D == 128) return attend_body(a, b, h0, h1, 128, narrow, 0);
    return attend_body(a, b, h0, h1, a->D, narrow, 0);
}

/* A decode batch with too few (sequence, kv head) items to keep the threads even (batch 1: 3 kv heads on 2 threads
 * ran as 2 and 1) runs attend_body's arithmetic in three phases that split finer: the scores of runs of blocks
 * (split_scores), each query row's softmax, and PV by 32 columns of a kv head (split_pv), whose sums are each
 * output's own. Every score, softmax and sum is computed as attend_body computes it, in position order: the
 * same bits. s: the batch's scores, sequence b's Hq rows of n_b at s_off[b]. */
struct split_unit { int64_t b, h, lo, hi; };  /* scores: blocks lo .. hi - 1; PV: columns lo .. hi - 1 */

PD_INLINE int split_scores(const struct attn *a, const struct split_unit *u, float *s, int64_t n, const int64_t D,
                           const int narrow) {
    const int64_t Hkv = a->Hkv, G = a->Hq / Hkv, bs = a->block_size, len = a->seq_lens[u->b];
    const int64_t first = first_visible(a, u->b);
    float *tmp = get_scratch((size_t)(bs * D));
    if (!tmp) return -2;
    const int32_t *table = a->tables + u->b * a->table_s0;
    const float *qh = a->q + u->b * a->q_s0 + u->h * G * a->q_s1;
    for (int64_t blk = u->lo; blk < u->hi; blk++) {
        const int32_t block = table[blk];
        if (block < 0 || block >= a->num_blocks) return -1;
        const int64_t p = blk * bs > first ? blk * bs : first, off = p - blk * bs;
        const int64_t cnt = bs - off < len - p ? bs - off : len - p;
        const int32_t next = blk + 1 < u->hi ? table[blk + 1] : -1;
        if (next >= 0 && next < a->num_blocks)
            for (int64_t j = 0; j < bs; j++) prefetch_row(a->k_cache, a->bf16, (next * bs + j) * Hkv + u->h, D, D);
        int64_t ks;
        const float *kb = block_rows(a->k_cache, a->bf16, (block * bs + off) * Hkv + u->h, cnt, Hkv, D, D, tmp, &ks);
        head_scores(a, qh, kb, ks, cnt, G, D, narrow, s + u->h * G * n + p - first, n, NULL, 0);
    }
    return 0;
}

PD_INLINE int split_pv(const struct attn *a, const struct split_unit *u, const float *s, int64_t n, const int64_t D,
                       const int narrow) {
    const int64_t Hkv = a->Hkv, G = a->Hq / Hkv, bs = a->block_size, len = a->seq_lens[u->b];
    const int64_t first = first_visible(a, u->b);
    float *tmp = get_scratch((size_t)(bs * D));
    if (!tmp) return -2;
    const int32_t *table = a->tables + u->b * a->table_s0;
    float *out = a->out + (u->b * a->Hq + u->h * G) * D;
    for (int64_t blk = first / bs, p = first; p < len; blk++) {
        const int32_t block = table[blk];  /* checked by split_scores */
        const int32_t next = (blk + 1) * bs < len ? table[blk + 1] : -1;
        const int64_t off = p - blk * bs, cnt = bs - off < len - p ? bs - off : len - p;
        if (next >= 0)
            for (int64_t j = 0; j < bs; j++) prefetch_row(a->v_cache, a->bf16, (next * bs + j) * Hkv + u->h, D, D);
        int64_t vs;
        const float *vb = block_rows(a->v_cache, a->bf16, (block * bs + off) * Hkv + u->h, cnt, Hkv, D, D, tmp, &vs);
        const float *w = s + u->h * G * n + p - first;
        if (narrow)
            for (int64_t g = 0; g < G; g += 3)
                pv_group_narrow(G, g, w + g * n, n, vb, vs, cnt, D, u->lo, p == first, out + g * D);
        else
            pv_all_rows(G, w, n, vb + u->lo, vs, cnt, u->hi - u->lo, D, p == first, out + u->lo, NULL, 0);
        p += cnt;
    }
    return 0;
}

/* The three phases on nthreads threads (D % 32 == 0, D <= 128). Returns 0, -1 or -2 as attend_body. */
PD_CLONES
static int decode_attention_split(const struct attn *a, int64_t B, int nthreads) {
    const int narrow = !wide16();
    const int64_t Hkv = a->Hkv, Hq = a->Hq, D = a->D, bs = a->block_size;
    int64_t *s_off = malloc((size_t)(B + 1) * sizeof(int64_t)), blocks = 0;
    if (!s_off) return -2;
    s_off[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = a->seq_lens[b], first = first_visible(a, b);
        s_off[b + 1] = s_off[b] + Hq * (len - first);
        blocks += (len - 1) / bs - first / bs + 1;
    }
    /* runs of blocks: about 8 a thread over the batch's kv heads */
    const int64_t run = blocks * Hkv / (8 * nthreads) > 1 ? blocks * Hkv / (8 * nthreads) : 1;
    const int64_t parts = D / 32, num_pv = B * Hkv * parts;
    int64_t num_scores = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = a->seq_lens[b], first = first_visible(a, b);
        num_scores += Hkv * (((len - 1) / bs - first / bs + run) / run);
    }
    float *s = malloc((size_t)s_off[B] * sizeof(float));
    struct split_unit *units = malloc((size_t)(num_scores + num_pv) * sizeof *units);
    int status = s && units ? 0 : -2;
    if (!status) {
        int64_t i = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t len = a->seq_lens[b], first = first_visible(a, b);
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t blk = first / bs; blk <= (len - 1) / bs; blk += run)
                    units[i++] = (struct split_unit){b, h, blk, blk + run < (len - 1) / bs + 1 ? blk + run
                                                                                            : (len - 1) / bs + 1};
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t c = 0; c < parts; c++) units[i++] = (struct split_unit){b, h, 32 * c, 32 * c + 32};
        #pragma omp parallel num_threads(nthreads)
        {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t k = 0; k < num_scores; k++) {
                const struct split_unit *u = &units[k];
                const int64_t n = (s_off[u->b + 1] - s_off[u->b]) / Hq;
                int rc = D == 64 ? split_scores(a, u, s + s_off[u->b], n, 64, narrow)
                                 : split_scores(a, u, s + s_off[u->b], n, D, narrow);
                if (rc) {
                    #pragma omp atomic write
                    status = rc;
                }
            }
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < B * Hq; r++) {
                const int64_t n = (s_off[r / Hq + 1] - s_off[r / Hq]) / Hq;
                if (!status) softmax_row(s + s_off[r / Hq] + r % Hq * n, n);
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t k = num_scores; k < num_scores + num_pv; k++) {
                const struct split_unit *u = &units[k];
                const int64_t n = (s_off[u->b + 1] - s_off[u->b]) / Hq;
                int rc = status ? 0 : D == 64 ? split_pv(a, u, s + s_off[u->b], n, 64, narrow)
                                              : split_pv(a, u, s + s_off[u->b], n, D, narrow);
                if (rc) {
                    #pragma omp atomic write
                    status = rc;
                }
            }
        }
    }
    free(units);
    free(s);
    free(s_off);
    return status;
}

/* One new token per sequence (query row b is sequence b: query_start_loc must be 0, 1, .., B). q [B, Hq, D] fp32
 * (stride q_s0, q_s1); caches [num_blocks, block_size, Hkv, D] fp32 or bf16; tables [B, max_blocks] int32 (row
 * stride table_s0); window 0 = none, softcap 0 = none; out [B, Hq, D] contiguous fp32.
 * Returns 0; 1 when this is not such a batch (a query_start_loc or a seq_len < 1: the caller's general path);
 * -1 a block id out of range; -2 out of memory; -3 a seq_len beyond its block table. */
int pd_decode_attention(const float *q, int64_t q_s0, int64_t q_s1, int64_t B, int64_t Hq, int64_t D,
                        const void *k_cache, const void *v_cache, int bf16, int64_t num_blocks, int64_t block_size,
                        int64_t Hkv, const int32_t *tables, int64_t table_s0, int64_t max_blocks,
                        const int32_t *seq_lens, const int32_t *query_start_loc, float scale, int64_t window,
                        float softcap, float *out, int nthreads) {
    for (int64_t b = 0; b <= B; b++)
        if (query_start_loc[b] != b) return 1;
    int64_t work = 0;  /* (position, kv head) pairs */
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] < 1) return 1;
        if ((seq_lens[b] + block_size - 1) / block_size > max_blocks) return -3;
        work += (window > 0 && seq_lens[b] > window ? window : seq_lens[b]) * Hkv;
    }
    const int split = B * Hkv < 2 * (int64_t)nthreads && D % 32 == 0 && D <= 128;
    if (work < PARALLEL_WORK) nthreads = 1;
    struct attn a = {q, q_s0, q_s1, Hq, D, k_cache, v_cache, bf16, num_blocks, block_size, Hkv, tables, table_s0,
                     seq_lens, scale, softcap, window, out, query_start_loc};
    /* Items: one sequence's kv heads all together (each slot row read once) when there are sequences enough for
     * the threads, else one kv head each; fewer of those than twice the threads: the split phases. */
    int status = 0;
    const int64_t per_item = B >= 2 * (int64_t)nthreads ? Hkv : 1, items = B * (Hkv / per_item);
    if (nthreads > 1 && split) return decode_attention_split(&a, B, nthreads);
    if (nthreads > 1 && items > 1) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t i = 0; i < items; i++) {
            int64_t b = i / (Hkv / per_item), h0 = i % (Hkv / per_item) * per_item;
            int rc = attend_item(&a, b, h0, h0 + per_item);
            if (rc) {
                #pragma omp atomic write
                status = rc;
            }
        }
    } else {
        for (int64_t i = 0; i < items && !status; i++) {
            int64_t b = i / (Hkv / per_item), h0 = i % (Hkv / per_item) * per_item;
            status = attend_item(&a, b, h0, h0 + per_item);
        }
    }
    return status;
}

/* Sequence b's new tokens i0 .. i1 - 1 (query rows starts[b] + i at positions len - q_len + i) against kv head h,
 * with its G query heads. Every row gets attend_body's arithmetic for a sequence of length position + 1: its
 * scores in position order, softmax_row over them, PV in position order; the tile only shares the K and V rows
 * it reads between its rows. So a row's result does not depend on the tile, the batch, the thread count or how
 * many earlier positions were cached, and it equals the decode kernel's for the same position bit for bit.
 * Returns 0; -1 a block id outside [0, num_blocks); -2 out of memory. */
PD_INLINE int prefill_body(const struct attn *a, int64_t b, int64_t h, int64_t i0, int64_t i1, const int64_t D,
                           const int narrow) {
    const int64_t Hkv = a->Hkv, G = a->Hq / Hkv, bs = a->block_size, W = a->window;
    const int64_t start = a->starts[b], pos0 = a->seq_lens[b] - (a->starts[b + 1] - start);
    const int64_t last = pos0 + i1 - 1;  /* the tile's last position */
    const int64_t lo = W > 0 && pos0 + i0 + 1 > W ? pos0 + i0 + 1 - W : 0;  /* the first row's first visible one */
    const int64_t span = last + 1 - lo, stride = (span + 31) / 16 * 16;
    /* K and V of positions lo .. last as fp32 rows (K padded with 16 zero rows for the last group of 16 scores),
     * then the scores of one position's G rows: row g at g * stride, position p at p - lo */
    float *kbuf = get_scratch((size_t)((2 * span + 16) * D + G * stride));
    if (!kbuf) return -2;
    float *vbuf = kbuf + (span + 16) * D, *scores = vbuf + span * D;
    const int32_t *table = a->tables + b * a->table_s0;
    for (int64_t p = lo; p <= last; p++) {
        const int32_t block = table[p / bs];
        if (block < 0 || block >= a->num_blocks) return -1;
        const int64_t index = (block * bs + p % bs) * Hkv + h;
        const float *kr = cache_row(a->k_cache, a->bf16, index, D, kbuf + (p - lo) * D, D);
        const float *vr = cache_row(a->v_cache, a->bf16, index, D, vbuf + (p - lo) * D, D);
        if (!a->bf16) {
            memcpy(kbuf + (p - lo) * D, kr, (size_t)D * sizeof(float));
            memcpy(vbuf + (p - lo) * D, vr, (size_t)D * sizeof(float));
        }
    }
    memset(kbuf + span * D, 0, (size_t)(16 * D) * sizeof(float));
    for (int64_t i = i0; i < i1; i++) {
        const int64_t pos = pos0 + i, first = W > 0 && pos + 1 > W ? pos + 1 - W : 0, n = pos + 1 - first;
        const float *qi = a->q + (start + i) * a->q_s0 + h * G * a->q_s1;
        float *s = scores + first - lo;
        if (D % 16 == 0) {
            for (int64_t j = 0; j < n; j += 16)
                scores16(qi, a->q_s1, G, kbuf + (first - lo + j) * D, D, D, a->scale, a->softcap, s + j, stride,
                         narrow, NULL, 0);
        } else {
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < n; j++)
                    s[g * stride + j] = score(qi + g * a->q_s1, kbuf + (first - lo + j) * D, D, a->scale, a->softcap,
                                             narrow);
        }
        for (int64_t g = 0; g < G; g++) softmax_row(s + g * stride, n);
        float *o = a->out + ((start + i) * a->Hq + h * G) * D;
        const float *v = vbuf + (first - lo) * D;
        if (D % 32 == 0 && narrow) {  /* three rows, 32 columns a pass */
            for (int64_t g = 0; g < G; g += 3)
                for (int64_t c = 0; c < D; c += 32)
                    pv_group_narrow(G, g, s + g * stride, stride, v, D, n, D, c, 1, o + g * D);
        } else if (D % 16 == 0 && D <= 128) {
            pv_all_rows(G, s, stride, v, D, n, D, D, 1, o, NULL, 0);
        } else {
            memset(o, 0, (size_t)(G * D) * sizeof(float));
            for (int64_t j = 0; j < n; j++)
                for (int64_t g = 0; g < G; g++) axpy(o + g * D, s[g * stride + j], v + j * D, D);
        }
    }
    return 0;
}

PD_CLONES
static int prefill_item(const struct attn *a, int64_t b, int64_t h, int64_t i0, int64_t i1) {
    /* Without AVX512 a 16-lane vector takes two registers or four: the narrow blocking (same bits) then fits. */
    if (wide16()) {
        if (a->D == 64) return prefill_body(a, b, h, i0, i1, 64, 0);
        if (a->D == 128) return prefill_body(a, b, h, i0, i1, 128, 0);
        return prefill_body(a, b, h, i0, i1, a->D, 0);
    }
    if (a->D == 64) return prefill_body(a, b, h, i0, i1, 64, 1);
    if (a->D == 128) return prefill_body(a, b, h, i0, i1, 128, 1);
    return prefill_body(a, b, h, i0, i1, a->D, 1);
}

/* Positions a tile holds at most: it copies the K and V rows its positions see once, for all of them. */
#define TILE_POSITIONS 64

/* Varlen causal attention: sequence b's new tokens are query rows query_start_loc[b] .. query_start_loc[b + 1] - 1
 * (q [T, Hq, D] fp32, strides q_s0, q_s1) at positions seq_lens[b] - q_len .. seq_lens[b] - 1; out [T, Hq, D]
 * contiguous fp32 (rows of no sequence are not written). A pure decode batch runs pd_decode_attention; anything
 * else works in tiles of one sequence, one kv head and up to TILE_POSITIONS positions (prefill_body). Returns 0; -1 a
 * block id out of range; -2 out of memory; -3 a seq_len beyond its block table; -4 query_start_loc not
 * non-decreasing within [0, T], or a sequence with more new tokens than its seq_len. */
int pd_paged_attention(const float *q, int64_t q_s0, int64_t q_s1, int64_t T, int64_t B, int64_t Hq, int64_t D,
                       const void *k_cache, const void *v_cache, int bf16, int64_t num_blocks, int64_t block_size,
                       int64_t Hkv, const int32_t *tables, int64_t table_s0, int64_t max_blocks,
                       const int32_t *seq_lens, const int32_t *query_start_loc, float scale, int64_t window,
                       float softcap, float *out, int nthreads) {
    if (T == B) {
        int rc = pd_decode_attention(q, q_s0, q_s1, B, Hq, D, k_cache, v_cache, bf16, num_blocks, block_size, Hkv,
                                     tables, table_s0, max_blocks, seq_lens, query_start_loc, scale, window, softcap,
                                     out, nthreads);
        if (rc != 1) return rc;
    }
    if (query_start_loc[0] < 0) return -4;
    const int64_t per_tile = TILE_POSITIONS;
    int64_t items = 0, work = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t q_len = (int64_t)query_start_loc[b + 1] - query_start_loc[b], len = seq_lens[b];
        if (q_len < 0 || query_start_loc[b + 1] > T || q_len > len) return -4;
        if ((len + block_size - 1) / block_size > max_blocks) return -3;
        items += (q_len + per_tile - 1) / per_tile * Hkv;
        work += q_len * (window > 0 && len > window ? window : len) * Hkv;
    }
    int64_t *item = malloc((size_t)(items > 0 ? items : 1) * 3 * sizeof(int64_t));  /* (b, h, i0) */
    if (!item) return -2;
    /* The longest tiles (last positions) first, so that dynamic scheduling ends with short ones. */
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
        for (int64_t t = (q_len + per_tile - 1) / per_tile - 1; t >= 0; t--)
            for (int64_t h = 0; h < Hkv; h++, n++) {
                item[3 * n] = b;
                item[3 * n + 1] = h;
                item[3 * n + 2] = t * per_tile;
            }
    }
    struct attn a = {q, q_s0, q_s1, Hq, D, k_cache, v_cache, bf16, num_blocks, block_size, Hkv, tables, table_s0,
                     seq_lens, scale, softcap, window, out, query_start_loc};
    int status = 0;
    if (nthreads > 1 && items > 1 && work >= PARALLEL_WORK) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t i = 0; i < items; i++) {
            const int64_t b = item[3 * i], i0 = item[3 * i + 2];
            const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
            int rc = prefill_item(&a, b, item[3 * i + 1], i0, i0 + per_tile < q_len ? i0 + per_tile : q_len);
            if (rc) {
                #pragma omp atomic write
                status = rc;
            }
        }
    } else {
        for (int64_t i = 0; i < items && !status; i++) {
            const int64_t b = item[3 * i], i0 = item[3 * i + 2];
            const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
            status = prefill_item(&a, b, item[3 * i + 1], i0, i0 + per_tile < q_len ? i0 + per_tile : q_len);
        }
    }
    free(item);
    return status;
}

/* ------------------------------------------------------------------------------------------------ decode layers */
/* A pure decode batch (one new token per sequence) through every layer of a pre-norm Llama-family decoder in one
 * call: the entry points above and the matmul library's pd_matmul (kernels/cpu_matmul.c, reached through the
 * function pointer in struct pd_decoder), called in engine.model.DecoderModel.hidden_states' order on the same
 * values, so the result is that of the eager step bit for bit; what it saves is the ~10 Python-dispatched calls
 * and allocations of each layer. */
typedef int (*pd_matmul_fn)(const void *operands, const float *x, int64_t M, float *y, int nthreads);

struct pd_linear { const void *operands; const float *bias; int64_t out; };  /* bias NULL: none */

struct pd_layer {
    const float *input_norm, *post_norm;
    struct pd_linear qkv, o, gate_up, down;
    const float *cos_sin;  /* [max_position, rot_dim] */
    int64_t window;        /* 0: full attention */
};

struct pd_decoder {
    int64_t num_layers, hidden, Hq, Hkv, D, intermediate, rot_dim, max_position;
    float eps, scale, softcap;  /* softcap 0: none */
    pd_matmul_fn matmul;
    const struct pd_layer *layers;
    const float *final_norm;
};

static __thread float *layer_scratch = NULL;
static __thread size_t layer_scratch_floats = 0;

static int linear(const struct pd_decoder *m, const struct pd_linear *l, const float *x, int64_t B, float *y,
                  int nthreads) {
    if (m->matmul(l->operands, x, B, y, nthreads) < 0) return -2;
    if (l->bias)
        for (int64_t t = 0; t < B; t++)
            for (int64_t n = 0; n < l->out; n++) y[t * l->out + n] += l->bias[n];
    return 0;
}

/* Whether the batch is one every entry point takes without an error: one new token per sequence, positions,
 * slots and the block ids in use within range. */
static int decode_batch_ok(const struct pd_decoder *m, int64_t B, const int64_t *positions, const int64_t *slots,
                           int64_t num_slots, int64_t num_blocks, int64_t block_size, const int32_t *tables,
                           int64_t max_blocks, const int32_t *seq_lens, const int32_t *query_start_loc) {
    for (int64_t b = 0; b <= B; b++)
        if (query_start_loc[b] != b) return 0;
    for (int64_t b = 0; b < B; b++) {
        if (positions[b] < 0 || positions[b] >= m->max_position || slots[b] < -1 || slots[b] >= num_slots)
            return 0;
        const int64_t used = ((int64_t)seq_lens[b] + block_size - 1) / block_size;
        if (seq_lens[b] < 1 || used > max_blocks) return 0;
        for (int64_t j = 0; j < used; j++)
            if (tables[b * max_blocks + j] < 0 || tables[b * max_blocks + j] >= num_blocks) return 0;
    }
    return 1;
}

/* h [B, hidden] (the embedded tokens) -> out [B, hidden], the final-norm hidden states; kv_cache [layers, 2,
 * num_blocks, block_size, Hkv, D] contiguous fp32 or bf16; tables [B, max_blocks] contiguous. Returns 0; 1 when
 * decode_batch_ok fails (nothing was written: the caller's eager step runs it, or names what is wrong); -2 out
 * of memory (the KV of the layers before may have been written: the same values a rerun writes). */
int pd_decode_layers(const struct pd_decoder *m, const float *h, int64_t B, const int64_t *positions,
                     const int64_t *slots, void *kv_cache, int bf16, int64_t num_blocks, int64_t block_size,
                     const int32_t *tables, int64_t max_blocks, const int32_t *seq_lens,
                     const int32_t *query_start_loc, float *out, int nthreads) {
    const int64_t H = m->hidden, D = m->D, q_size = m->Hq * D, kv_size = m->Hkv * D, QKV = q_size + 2 * kv_size;
    const int64_t I = m->intermediate, layer_values = num_blocks * block_size * kv_size;
    if (!decode_batch_ok(m, B, positions, slots, num_blocks * block_size, num_blocks, block_size, tables, max_blocks,
                         seq_lens, query_start_loc))
        return 1;
    const size_t floats = (size_t)B * (4 * H + QKV + q_size + 3 * I);
    if (floats > layer_scratch_floats) {
        free(layer_scratch);
        layer_scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        layer_scratch_floats = layer_scratch ? floats : 0;
        if (!layer_scratch) return -2;
    }
    float *x = layer_scratch, *res_a = x + B * H, *res_b = res_a + B * H, *hb = res_b + B * H;
    float *qkv = hb + B * H, *attn = qkv + B * QKV, *gate_up = attn + B * q_size, *act = gate_up + B * 2 * I;
    const float *res = h;
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m->num_layers; i++) {
        const struct pd_layer *l = &m->layers[i];
        float *next = res == res_a ? res_b : res_a;
        if (i == 0) {
            pd_rms_norm(h, H, NULL, 0, l->input_norm, B, H, m->eps, x, NULL, nthreads);
        } else {
            pd_rms_norm(hb, H, res, H, l->input_norm, B, H, m->eps, x, next, nthreads);
            res = next;
            next = res == res_a ? res_b : res_a;
        }
        if (linear(m, &l->qkv, x, B, qkv, nthreads)) return -2;
        pd_rotary(positions, B, qkv, QKV, D, m->Hq, qkv + q_size, QKV, D, m->Hkv, l->cos_sin, m->max_position,
                  m->rot_dim, nthreads);
        char *k_cache = (char *)kv_cache + (size_t)(2 * i) * layer_values * elem;
        char *v_cache = k_cache + layer_values * elem;
        pd_write_kv(qkv + q_size, QKV, D, qkv + q_size + kv_size, QKV, D, B, m->Hkv, D, k_cache, v_cache, bf16,
                    num_blocks * block_size, slots);
        int rc = pd_decode_attention(qkv, QKV, D, B, m->Hq, D, k_cache, v_cache, bf16, num_blocks, block_size,
                                     m->Hkv, tables, max_blocks, max_blocks, seq_lens, query_start_loc, m->scale,
                                     l->window, m->softcap, attn, nthreads);
        if (rc) return rc == -2 ? -2 : 1;
        if (linear(m, &l->o, attn, B, hb, nthreads)) return -2;
        pd_rms_norm(hb, H, res, H, l->post_norm, B, H, m->eps, x, next, nthreads);
        res = next;
        if (linear(m, &l->gate_up, x, B, gate_up, nthreads)) return -2;
        pd_silu_mul(gate_up, 2 * I, B, I, act, nthreads);
        if (linear(m, &l->down, act, B, hb, nthreads)) return -2;
    }
    pd_rms_norm(hb, H, res, H, m->final_norm, B, H, m->eps, out, res == res_a ? res_b : res_a, nthreads);
    return 0;
}
