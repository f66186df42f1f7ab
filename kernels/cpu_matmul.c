/* Quantized CPU matmuls for engine.quant (kernels/cpu_matmul.py builds and loads this file; its docstring is the
 * contract). Plain C11, no torch headers; one function per ISA picked at run time:
 *   3  AVX512-VNNI + VBMI: level 2, the int4 codes spread into vpdpbusd's lanes by vpermt2b
 *   2  AVX512-VNNI (avx512f/bw/vl/dq + vnni): vpdpbusd, 64 products an instruction
 *   1  AVX2 + FMA: maddubs / madd on 32 codes at a time
 *   0  portable scalar
 * The bfloat16-activation kernels (q4_bf16_matmul, q8_bf16_matmul; section "bfloat16 x" below) read the
 * same weights; their level 2 needs only avx512f/bw (pd_bf16_best_isa).
 *
 * Both int8-activation kernels quantize each row of x to int8 per 32 inputs first (Q8_0 style, computed
 * identically on every
 * path): dx = absmax / 127, xq = round_half_even(x * (1 / dx)) (dx = 0: xq = 0), sumq = sum of the 32 xq.
 *
 * q4: W[n, k] = q * d + m, q in [0, 15], in int4pack_mm's layout with its (d, z) table (section "bfloat16 x"),
 *     m = z - 8 d (the (q - 8) * d + z form of engine.quant.Int4Linear). Per output, over the groups g in order:
 *     y = fmaf((float)isum_g, d * dx, y), then y = fmaf(m, dx * sumq, y),   isum_g = sum_j q * xq  (exact int32):
 *     the same bits on every path (section "q4, int8 x").
 * q8: W[n, k] = w[n, k] * ws[n], w int8 in [-127, 127].
 *     y[i, n] = ws[n] * sum_g dx * isum,   isum = sum_j w * xq  (exact int32).
 *     Only the float sums over groups differ between paths (summation order).
 *
 * One entry point, pd_matmul, takes a struct pd_weight (the weight and its kind, filled once) for every kind.
 *
 * Rows of x are independent (each is quantized and reduced on its own). Output rows are split over `nthreads`
 * OpenMP threads (the process's libgomp: torch's own when torch is loaded); x rows are taken a few at a time per
 * block of weight rows, so that block is read from memory once per call and reused from L1 / L2 for the others.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PD_X86 1
#else
#define PD_X86 0
#endif

#define MT 4          /* x rows per pass of the AVX2 and scalar bfloat16-activation kernels */
/* How far ahead the AVX512 loops prefetch the weight stream (rows are contiguous, so this runs into the next
 * rows): +11% on the default model's 30 layers at batch 1 on Zen 4 (1536-4096 alike, 512 too short). */
#define PREFETCH_BYTES 2048
/* The q8 bfloat16 kernels (the LM head: 28 MB streamed at one byte per weight, memory-bound) also prefetch this
 * far ahead into L2: measured on Zen 4 for the 49152 x 576 head at batch 1 (best of 30 calls over 3 copies, a
 * loaded machine), AVX512 3.3 -> 2.4 ms on one thread and 1.7 -> 1.0-1.2 ms on two, AVX2 3.2-3.5 -> 2.8 ms on
 * one; 8 KiB gave less, 32 KiB the same. The q4 kernels are bound by their FMAs on one core: it slowed them. */
#define PREFETCH_L2_BYTES 16384

/* ------------------------------------------------------------------------------------------------ helpers */
static inline float bf16_lo(uint32_t v) { union { uint32_t u; float f; } c = {v << 16}; return c.f; }
static inline float bf16_hi(uint32_t v) { union { uint32_t u; float f; } c = {v & 0xFFFF0000u}; return c.f; }

/* The thread-local scratch of one call (x quantized, its scales): grown, never shrunk. */
static __thread void *scratch = NULL;
static __thread size_t scratch_size = 0;

static void *get_scratch(size_t size) {
    if (size > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (size + 63) / 64 * 64);
        scratch_size = scratch ? size : 0;
    }
    return scratch;
}

/* Quantize one group of 32 floats: writes xq[0..31] in natural order, returns dx, sets *sumq. Using dx * sumq
 * (not the float sum of x) in the q4 offset term keeps y the exact product of W with the rounded x: measured
 * on the default model, the float sum doubles the logit error (the offset's error no longer cancels). Same arithmetic
 * on every path for finite x (scalar float ops; nearbyintf rounds half to even in the default rounding mode; a
 * NaN product, 0 times the infinite reciprocal of a scale below 2^-128, clamps to -127 as vmaxps does). */
static inline float quant_group(const float *x, int8_t *xq, int32_t *sumq) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) { float a = fabsf(x[j]); amax = a > amax ? a : amax; }
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < 32; j++) {
        float r = nearbyintf(x[j] * id);
        int q = (int)fminf(fmaxf(r, -127.0f), 127.0f);
        xq[j] = (int8_t)q;
        s += q;
    }
    *sumq = s;
    return d;
}

/* Per x row: xq [K] in natural order, dx [G], sx = dx * sumq [G] (q4) and sq = sumq [G] (q8). */
static void quant_row(const float *x, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *sq) {
    for (int64_t g = 0; g < K / 32; g++) {
        int32_t sumq;
        dx[g] = quant_group(x + 32 * g, xq + 32 * g, &sumq);
        sx[g] = dx[g] * (float)sumq;
        sq[g] = sumq;
    }
}

#if PD_X86
/* ------------------------------------------------------------------------------------------------ AVX2 */
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
/* v as it stands, in a register: GCC otherwise reassociates a pass's integer sums into a tree over all the
 * passes' products, live at once, and spills them. */
#define PD_KEEP(v) __asm__("" : "+x"(v))

AVX2_TARGET static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* quant_row's values, a group (four registers) at a time, as quant_row_avx512 computes them (below): the same
 * absmax (NaNs passed over), scalar division and reciprocal, each x * (1 / dx) rounded to float, then to the
 * nearest integer (ties to even), clamped (a NaN to -127, as fmaxf gives) and summed exactly. Without it AVX2
 * hosts quantized x by a libm nearbyintf call an input: 4 us a row of 576, a quarter of a 32-row matmul's time. */
AVX2_TARGET static void quant_row_avx2(const float *x, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *sq) {
    const __m256 lim = _mm256_set1_ps(127.0f), neg = _mm256_set1_ps(-127.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int h = 0; h < 4; h++) {
            v[h] = _mm256_loadu_ps(x + 32 * g + 8 * h);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[h]), m);  /* max(NaN, m) is m */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 inv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int h = 0; h < 4; h++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, neg), lim));
        }
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + 32 * g), _mm256_permutevar8x32_epi32(bytes, order));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        const int32_t sumq = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
        dx[g] = d;
        sx[g] = d * (float)sumq;
        sq[g] = sumq;
    }
}

/* ------------------------------------------------------------------------------------------------ AVX512-VNNI */
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

/* quant_row's values, a group (two registers) at a time: the same absmax, scalar division and reciprocal, each
 * x * (1 / dx) rounded to float as there, then to the nearest integer (ties to even, as nearbyintf in the default
 * mode), clamped and summed exactly. */
VNNI_TARGET static void quant_row_avx512(const float *x, int64_t K, int8_t *xq, float *dx, float *sx,
                                         int32_t *sq) {
    const __m512 lim = _mm512_set1_ps(127.0f);
    for (int64_t g = 0; g < K / 32; g++) {
        const __m512 a = _mm512_loadu_ps(x + 32 * g), b = _mm512_loadu_ps(x + 32 * g + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 inv = _mm512_set1_ps(id);
        __m512i q[2];
        const __m512 v[2] = {a, b};
        for (int h = 0; h < 2; h++) {
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
            q[h] = _mm512_cvtps_epi32(r);
            _mm_storeu_si128((__m128i *)(xq + 32 * g + 16 * h), _mm512_cvtsepi32_epi8(q[h]));
        }
        const int32_t sumq = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
        dx[g] = d;
        sx[g] = d * (float)sumq;
        sq[g] = sumq;
    }
}

#endif

/* ------------------------------------------------------------------------------------------------ bfloat16 x */
/* The q4-bf16 / q8-bf16 kernels. x is rounded to bfloat16 (round half to even, as x.to(torch.bfloat16); a
 * result below FLT_MIN in magnitude becomes +0, as vdpbf16ps reads it) into scratch float32; products are summed in
 * float32; the output is rounded to bfloat16 (half to even, a NaN to 0x7FC0) unless round_out is 0 (tests).
 * q4 reads int4pack_mm's layout (the codes held once, shared with torch's kernel): blocks of B (64 with torch's
 * AVX512 packing, 32 with its AVX2 one) output channels, codes [N / B][K][B / 2] bytes, byte (k, d) holding
 * channel d of the block in its low nibble and channel B / 2 + d in its high one; tab [G][N] (d | z << 16,
 * bfloat16 each), W[n, k] = (q - 8) * d + z. Lanes are output channels, and each output is, over the groups g
 * of 32 inputs in order,
 *     s = 0;  for p = 0 .. 15:  s = fmaf(x[32 g + 2 p + 1], q'[.. + 1], s);  s = fmaf(x[32 g + 2 p], q'[..], s)
 *     y = fmaf(s, d_g, y);  y = fmaf(X_g, z_g, y)
 * with q' = q - 8 and X_g the float32 sum of the group's 32 (rounded) x in order (computed once per row). The
 * products x q' are exact, and the pairs in that order are exactly what vdpbf16ps (avx512_bf16) computes for a
 * bfloat16 pair (x_k, x_k+1) against (q'_k, q'_k+1) (checked at load: pd_bf16_dot_is_exact), so the AVX512-BF16
 * path, 32 products an instruction where an FMA does 16, gives every path's bits. Paths: from Q4P_DEQUANT_ROWS
 * rows of x, AVX512 dequantizes a block's q' once per call into an L1/L2 tile (bfloat16 pairs for
 * AVX512-BF16, float32 otherwise) and runs its passes from it; from Q4P_AVX2_DEQUANT_ROWS AVX2 dequantizes a
 * chunk of Q4P_AVX2_CHUNK inputs at a time into an L1 tile (float32) and runs every row over it before the next
 * (the totals kept in y between groups); below those (and on the scalar path) the codes are read in every pass.
 * The one difference from the float math besides the float32 sums: a partial sum s below FLT_MIN in magnitude
 * (activations near 1e-38) is flushed to zero by vdpbf16ps and kept by fmaf.
 * q8 (w int8 [N, K], ws [N]; int8pack_mm's arithmetic) dequantizes each weight exactly (w * ws) and sums by
 * float32 FMA; from Q8B_DEQUANT_ROWS rows of x the AVX512 path dequantizes a block of rows once into a tile.
 * At level 3 (AVX512-BF16) q8 sums the exact products x w by vdpbf16ps instead and scales the sum (q8b_bf16dot_tile).
 * An AVX512 q8 tile reduces its sums 16 at a time with _mm512_reduce_add_ps's additions (reduce_add16).
 * q8 lane orders: AVX512 lane l sums inputs 16 t + l in order of t, then _mm512_reduce_add_ps (int8pack_mm's
 * AVX512 order); AVX2 8 lanes over 8 t + l, reduced as int8pack_mm's AVX2 kernel reduces (halves, then pairs
 * 0x4E, then 0xB1); scalar one sum over k in order. */
#define Q4P_DEQUANT_ROWS 32
#ifndef Q4P_AVX2_DEQUANT_ROWS
#define Q4P_AVX2_DEQUANT_ROWS 64  /* from this many rows of x the AVX2 q4 path dequantizes chunks of the unit */
#endif
#define Q4P_AVX2_CHUNK 64         /* inputs per chunk: 16 KB of float32 for a block of 64 channels, in L1 */
#define MT_Q4P_AVX2 6             /* rows of x a pass over a chunk */
#ifndef Q4P_PAIR_ROWS
#define Q4P_PAIR_ROWS 2
#endif
#define MT_Q4P 3      /* AVX512 x rows per q4 pass: 3 rows x 4 slices of group sums and of totals, 24 registers */

static inline float round_bf16(float v) {
    union { float f; uint32_t u; } c = {v};
    if ((c.u & 0x7FFFFFFFu) > 0x7F800000u) { c.u = 0x7FC00000u; return c.f; }
    c.u = (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) & 0xFFFF0000u;
    return c.f;
}

#define NC 2          /* weight rows per tile of the AVX2 and scalar q8 bfloat16 kernels (each read once per tile) */
#define NC_Q8B 4      /* weight rows per tile of the AVX512 q8 bfloat16 kernel: each x load feeds four FMAs */
#define MT_Q8B 6      /* x rows per pass of the AVX512 q8 bfloat16 tile */
#define MT_Q8B3 4     /* x rows per pass of the level-3 q8 tile: 4 x 4 sums fill one reduce_add16 where 4 x 6
                         padded two (Zen 4, one thread, 1536 x 576 weights: 512 rows 0.88x the time of 6 a pass,
                         and the LM head at 32 and 64 rows 0.91x / 0.87x) */
#define NB_Q8B 8      /* weight rows per block of the q8 bfloat16 kernels (dequantized, 18 KB at K = 576: in L1) */
#define Q8B_DEQUANT_ROWS 12  /* from this many rows of x the AVX512 q8 bfloat16 path dequantizes each block once */

static void q4p_scalar(const uint8_t *codes, const uint32_t *tab, const float *xb, const float *xs, int64_t K,
                       int64_t N, int B, int64_t n, int64_t i, float *y) {
    const int64_t half = B / 2, c = n % B;
    const uint8_t *cb = codes + n / B * K * half + c % half;
    const int hi = c >= half;
    const float *xr = xb + i * K;
    float acc = 0.0f;
    for (int64_t g = 0; g < K / 32; g++) {
        float s = 0.0f;
        for (int64_t k = 32 * g; k < 32 * g + 32; k += 2)
            for (int64_t kk = k + 1; kk >= k; kk--) {
                uint8_t b = cb[kk * half];
                s = fmaf(xr[kk], (float)((hi ? b >> 4 : b & 15) - 8), s);
            }
        uint32_t t = tab[g * N + n];
        acc = fmaf(xs[i * (K / 32) + g], bf16_hi(t), fmaf(s, bf16_lo(t), acc));
    }
    *y = acc;
}

static void q8b_scalar(const int8_t *w, const float *ws, const float *xb, int64_t n, int64_t i, int64_t K,
                       float *y) {
    const int8_t *wr = w + n * K;
    const float *xr = xb + i * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++) acc = fmaf(xr[k], (float)wr[k] * ws[n], acc);
    *y = acc;
}

#if PD_X86
/* int8pack_mm's AVX2 reduction order. */
AVX2_TARGET static inline float hsum256_pairs(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
    return _mm256_cvtss_f32(v);
}

/* Channels n0 .. n0 + 15 (n0 % 16 == 0) of a q4 block against rows i0 .. i0 + R - 1: two 8-lane slices. */
AVX2_TARGET static inline __attribute__((always_inline)) void q4p_avx2_tile(
        const uint8_t *codes, const uint32_t *tab, const float *xb, const float *xs, int64_t K, int64_t N, int B,
        int64_t n0, int64_t i0, const int R, int round_out, float *y) {
    const int64_t half = B / 2, c0 = n0 % B, G = K / 32;
    const uint8_t *cb = codes + n0 / B * K * half;
    const int64_t off[2] = {c0 % half, (c0 + 8) % half};
    const int hi[2] = {c0 >= half, c0 + 8 >= half};
    const __m256i low = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[MT][2], s[MT][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
        for (int64_t k = 32 * g; k < 32 * g + 32; k += 2) {
            const uint8_t *bp = cb + k * half;
            _mm_prefetch((const char *)bp + PREFETCH_BYTES, _MM_HINT_T0);
            for (int64_t kk = k + 1; kk >= k; kk--) {
                __m256 w[2];
                for (int j = 0; j < 2; j++) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cb + kk * half + off[j])));
                    v = hi[j] ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, low);
                    w[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(v, eight));
                }
                for (int r = 0; r < R; r++) {
                    __m256 xv = _mm256_set1_ps(xb[(i0 + r) * K + kk]);
                    s[r][0] = _mm256_fmadd_ps(xv, w[0], s[r][0]);
                    s[r][1] = _mm256_fmadd_ps(xv, w[1], s[r][1]);
                }
            }
        }
        for (int j = 0; j < 2; j++) {
            __m256i t = _mm256_loadu_si256((const __m256i *)(tab + g * N + n0 + 8 * j));
            __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(t, 16)), z = _mm256_castsi256_ps(_mm256_and_si256(t, high));
            for (int r = 0; r < R; r++)
                acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(xs[(i0 + r) * G + g]), z,
                                            _mm256_fmadd_ps(s[r][j], d, acc[r][j]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2; j++) {
            float out[8];
            _mm256_storeu_ps(out, acc[r][j]);
            for (int l = 0; l < 8; l++) y[(i0 + r) * N + n0 + 8 * j + l] = round_out ? round_bf16(out[l]) : out[l];
        }
}

/* Channels n0 .. n0 + 15 (n0 % 16 == 0) of a q4 block against rows i0 .. i0 + R - 1 over inputs k0 .. k1 - 1
 * (whole groups) from W: their q' dequantized by q4p_avx2_dequant, row k at W + (k - k0) * ws. The totals wait in
 * y between groups (float32, exact: q4p_avx2_tile's fmaf chain, bit for bit), so that R = MT_Q4P_AVX2 rows x 2
 * slices of group sums and the weights fit AVX2's 16 registers: each weight load feeds 6 FMAs, not 4. */
AVX2_TARGET static inline __attribute__((always_inline)) void q4p_avx2_chunk(
        const float *W, int64_t ws, const uint32_t *tab, const float *xb, const float *xs, int64_t K, int64_t N,
        int64_t n0, int64_t k0, int64_t k1, int64_t i0, const int R, int round_out, float *y) {
    const int64_t G = K / 32;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t g = k0 / 32; g < k1 / 32; g++) {
        __m256 s[MT_Q4P_AVX2][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
        for (int64_t k = 32 * g; k < 32 * g + 32; k += 2)
            for (int64_t kk = k + 1; kk >= k; kk--) {
                const __m256 w0 = _mm256_loadu_ps(W + (kk - k0) * ws), w1 = _mm256_loadu_ps(W + (kk - k0) * ws + 8);
                for (int r = 0; r < R; r++) {
                    __m256 xv = _mm256_set1_ps(xb[(i0 + r) * K + kk]);
                    s[r][0] = _mm256_fmadd_ps(xv, w0, s[r][0]);
                    s[r][1] = _mm256_fmadd_ps(xv, w1, s[r][1]);
                }
            }
        for (int j = 0; j < 2; j++) {
            __m256i t = _mm256_loadu_si256((const __m256i *)(tab + g * N + n0 + 8 * j));
            const __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(t, 16));
            const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(t, high));
            for (int r = 0; r < R; r++) {
                float *out = y + (i0 + r) * N + n0 + 8 * j;
                __m256 acc = g ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
                _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_set1_ps(xs[(i0 + r) * G + g]), z,
                                                      _mm256_fmadd_ps(s[r][j], d, acc)));
                if (round_out && g == G - 1)
                    for (int l = 0; l < 8; l++) out[l] = round_bf16(out[l]);
            }
        }
    }
}

/* Channels c0 .. c1 - 1 of block n0 (B channels; c0 % 8 == 0) at inputs k0 .. k1 - 1 as float32 q' = q - 8 into
 * W [k1 - k0][c1 - c0]: the values q4p_avx2_tile decodes from the codes. */
AVX2_TARGET static void q4p_avx2_dequant(const uint8_t *codes, int64_t K, int B, int64_t n0, int64_t c0, int64_t c1,
                                         int64_t k0, int64_t k1, float *W) {
    const int64_t half = B / 2;
    const uint8_t *cb = codes + n0 / B * K * half;
    for (int64_t k = k0; k < k1; k++)
        for (int64_t c = c0; c < c1; c += 8) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cb + k * half + (c - n0) % half)));
            v = c - n0 >= half ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
            _mm256_storeu_ps(W + (k - k0) * (c1 - c0) + (c - c0),
                             _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))));
        }
}

#define CALL_Q4P_CHUNK(r) q4p_avx2_chunk(W, ws, tab, xb, xs, K, N, n0, k0, k1, i0, r, round_out, y)
AVX2_TARGET static void q4p_avx2_chunks(const float *W, int64_t ws, const uint32_t *tab, const float *xb,
                                        const float *xs, int64_t K, int64_t N, int64_t n0, int64_t k0, int64_t k1,
                                        int64_t i0, int R, int round_out, float *y) {
    switch (R) { case 1: CALL_Q4P_CHUNK(1); break; case 2: CALL_Q4P_CHUNK(2); break;
                 case 3: CALL_Q4P_CHUNK(3); break; case 4: CALL_Q4P_CHUNK(4); break;
                 case 5: CALL_Q4P_CHUNK(5); break; default: CALL_Q4P_CHUNK(6); break; }
}

/* Rows i0 .. i0 + R - 1 (R = 1, 2) against the 32 channels whose codes share code bytes o .. o + 15 of a q4 block
 * at n0: channels n0 + o .. + 15 in their low nibbles, n0 + B / 2 + o .. + 15 in their high ones. Each byte is
 * widened once for both (q4p_avx2_tile widens it once per 16-channel slice; batch-1 decode's matmuls 0.69x the
 * time). One row keeps its totals in registers, two in y between groups (float32, exact). The same sums. */
AVX2_TARGET static inline __attribute__((always_inline)) void q4p_avx2_pair_rows(
        const uint8_t *codes, const uint32_t *tab, const float *xb, const float *xs, int64_t K, int64_t N, int B,
        int64_t n0, int64_t o, int64_t i0, const int R, int round_out, float *y) {
    const int64_t half = B / 2, G = K / 32;
    const uint8_t *cb = codes + n0 / B * K * half + o;
    const int64_t ch[4] = {n0 + o, n0 + o + 8, n0 + half + o, n0 + half + o + 8};
    const __m256i low = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[4], s[2][4];
    for (int v = 0; v < 4; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) s[r][v] = _mm256_setzero_ps();
        for (int64_t k = 32 * g; k < 32 * g + 32; k += 2) {
            _mm_prefetch((const char *)(cb + k * half) + PREFETCH_BYTES, _MM_HINT_T0);
            for (int64_t kk = k + 1; kk >= k; kk--) {
                const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cb + kk * half)));
                const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cb + kk * half + 8)));
                const __m256i q[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low), _mm256_srli_epi32(b0, 4),
                                      _mm256_srli_epi32(b1, 4)};
                __m256 w[4];
                for (int v = 0; v < 4; v++) w[v] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[v], eight));
                for (int r = 0; r < R; r++) {
                    const __m256 xv = _mm256_set1_ps(xb[(i0 + r) * K + kk]);
                    for (int v = 0; v < 4; v++) s[r][v] = _mm256_fmadd_ps(xv, w[v], s[r][v]);
                }
            }
        }
        for (int v = 0; v < 4; v++) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(tab + g * N + ch[v]));
            const __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(t, 16));
            const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(t, high));
            for (int r = 0; r < R; r++) {
                float *out = y + (i0 + r) * N + ch[v];
                const __m256 prev = R == 1 ? acc[v] : g ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
                const __m256 a = _mm256_fmadd_ps(_mm256_set1_ps(xs[(i0 + r) * G + g]), z,
                                                 _mm256_fmadd_ps(s[r][v], d, prev));
                if (R == 1) acc[v] = a;
                else _mm256_storeu_ps(out, a);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) {
            float *out = y + (i0 + r) * N + ch[v];
            if (R == 1) _mm256_storeu_ps(out, acc[v]);
            if (round_out)
                for (int l = 0; l < 8; l++) out[l] = round_bf16(out[l]);
        }
}

AVX2_TARGET static void q4p_avx2_pair(const uint8_t *codes, const uint32_t *tab, const float *xb, const float *xs,
                                      int64_t K, int64_t N, int B, int64_t n0, int64_t o, int64_t i0, int R,
                                      int round_out, float *y) {
    if (R == 1) q4p_avx2_pair_rows(codes, tab, xb, xs, K, N, B, n0, o, i0, 1, round_out, y);
    else q4p_avx2_pair_rows(codes, tab, xb, xs, K, N, B, n0, o, i0, 2, round_out, y);
}

#define CALL_Q4P_AVX2(r) q4p_avx2_tile(codes, tab, xb, xs, K, N, B, n0, i0, r, round_out, y)
AVX2_TARGET static void q4p_avx2(const uint8_t *codes, const uint32_t *tab, const float *xb, const float *xs,
                                 int64_t K, int64_t N, int B, int64_t n0, int64_t i0, int R, int round_out, float *y) {
    switch (R) { case 1: CALL_Q4P_AVX2(1); break; case 2: CALL_Q4P_AVX2(2); break;
                 case 3: CALL_Q4P_AVX2(3); break; default: CALL_Q4P_AVX2(4); break; }
}

AVX2_TARGET static inline __attribute__((always_inline)) void q8b_avx2_tile(
        const int8_t *w, const float *ws, const float *xb, int64_t XS, int64_t n, const int C, int64_t i0, const int R,
        int64_t K, int64_t N, int round_out, float *y) {
    __m256 acc[NC][MT];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        for (int c = 0; c < C; c++) {
            const int8_t *wp = w + (n + c) * K + k;
            if (!(k & 63)) {
                _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)wp + PREFETCH_L2_BYTES, _MM_HINT_T1);
            }
            __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)wp))),
                                      _mm256_set1_ps(ws[n + c]));
            for (int r = 0; r < R; r++)
                acc[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + (i0 + r) * XS + k), wv, acc[c][r]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) {
            float v = hsum256_pairs(acc[c][r]);
            y[(i0 + r) * N + n + c] = round_out ? round_bf16(v) : v;
        }
}

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma")))

AVX512_TARGET static inline __m512 round_bf16_512(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

/* Channels n0 + 16 j .. + 15 of a q4 block are slice j (j < B / 16): for B = 64 the low nibbles of code bytes
 * 16 (j % 2) .. + 15 for j < 2, their high nibbles for j >= 2; for B = 32 the low (j = 0) or high (j = 1)
 * nibbles of bytes 0 .. 15. A work unit is slices s0 .. s0 + S - 1 of a block: the whole block, or one half
 * (the channels of the low or of the high nibbles), so that threads can split a block between them. */
#define Q4P_OFF(B, j) ((B) == 64 ? 16 * ((j) & 1) : 0)
#define Q4P_SHIFT(B, j) ((B) == 64 ? 4 * ((j) >> 1) : 4 * (j))

/* The codes of slices s0 .. s0 + S - 1 at input k (c[j - s0]) from its code bytes bp, one per 32-bit lane in its
 * low 4 bits (vpermps / vpermd read only those: the high nibble's lanes need no mask). */
AVX512_TARGET static inline __attribute__((always_inline)) void q4p_avx512_codes(
        const uint8_t *bp, const int B, const int s0, const int S, __m512i *c) {
    __m512i v[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  /* code bytes 0-15 and 16-31, zero-extended */
    for (int o = 0; o < 2; o++)
        for (int j = s0; j < s0 + S; j++)
            if (Q4P_OFF(B, j) == 16 * o) { v[o] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bp + 16 * o))); break; }
    for (int j = s0; j < s0 + S; j++) {
        c[j - s0] = v[Q4P_OFF(B, j) / 16];
        if (Q4P_SHIFT(B, j)) c[j - s0] = _mm512_srli_epi32(c[j - s0], 4);
    }
}

/* q' = q - 8 as float32 for slices s0 .. s0 + S - 1 at input k (w[j - s0]). */
AVX512_TARGET static inline __attribute__((always_inline)) void q4p_avx512_weights(
        const uint8_t *bp, const int B, const int s0, const int S, __m512 *w) {
    const __m512 codes_minus_8 = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    __m512i c[4];
    q4p_avx512_codes(bp, B, s0, S, c);
    for (int j = 0; j < S; j++) w[j] = _mm512_permutexvar_ps(c[j], codes_minus_8);
}

/* A group's sums s folded into the totals: acc = fmaf(X_g, z, fmaf(s, d, acc)) (tp: the group's row of tab at n0). */
AVX512_TARGET static inline __attribute__((always_inline)) void q4p_avx512_fold(
        const uint32_t *tp, const float *xs, int64_t G, int64_t g, const int s0, const int S, int64_t i0,
        const int R, __m512 (*s)[4], __m512 (*acc)[4]) {
    for (int j = 0; j < S; j++) {
        __m512i t = _mm512_loadu_si512((const void *)(tp + 16 * (s0 + j)));
        __m512 d = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
        __m512 z = _mm512_castsi512_ps(_mm512_and_si512(t, _mm512_set1_epi32((int)0xFFFF0000u)));
        for (int r = 0; r < R; r++)
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(i0 + r) * G + g]), z, _mm512_fmadd_ps(s[r][j], d, acc[r][j]));
    }
}

AVX512_TARGET static inline __attribute__((always_inline)) void q4p_avx512_store(
        const __m512 (*acc)[4], int64_t N, int64_t n0, const int s0, const int S, int64_t i0, const int R,
        int round_out, float *y) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < S; j++)
            _mm512_storeu_ps(y + (i0 + r) * N + n0 + 16 * (s0 + j), round_out ? round_bf16_512(acc[r][j]) : acc[r][j]);
}

/* Slices s0 .. s0 + S - 1 of block n0 (B channels) against rows i0 .. i0 + R - 1 by float32 FMA; W (when not
 * NULL): those slices' q' dequantized earlier, [K][16 S] float32, read instead of the codes. */
AVX512_TARGET static inline __attribute__((always_inline)) void q4p_avx512_tile(
        const uint8_t *codes, const uint32_t *tab, const float *W, const float *xb, const float *xs, int64_t K,
        int64_t N, const int B, int64_t n0, const int s0, const int S, int64_t i0, const int R, int round_out,
        float *y) {
    const int64_t half = B / 2, G = K / 32;
    const uint8_t *cb = codes + n0 / B * K * half;
    __m512 acc[MT_Q4P][4], s[MT_Q4P][4], w[4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < S; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < S; j++) s[r][j] = _mm512_setzero_ps();
        for (int64_t k = 32 * g; k < 32 * g + 32; k += 2) {
            if (!W) _mm_prefetch((const char *)(cb + k * half) + PREFETCH_BYTES, _MM_HINT_T0);
            for (int64_t kk = k + 1; kk >= k; kk--) {
                if (W) {
                    for (int j = 0; j < S; j++) w[j] = _mm512_loadu_ps(W + kk * 16 * S + 16 * j);
                } else {
                    q4p_avx512_weights(cb + kk * half, B, s0, S, w);
                }
                for (int r = 0; r < R; r++) {
                    __m512 xv = _mm512_set1_ps(xb[(i0 + r) * K + kk]);
                    for (int j = 0; j < S; j++) s[r][j] = _mm512_fmadd_ps(xv, w[j], s[r][j]);
                }
            }
        }
        q4p_avx512_fold(tab + g * N + n0, xs, G, g, s0, S, i0, R, s, acc);
    }
    q4p_avx512_store((const __m512 (*)[4])acc, N, n0, s0, S, i0, R, round_out, y);
}

/* The same sums by vdpbf16ps: Wp [K / 2][16 S] holds each slice's (q'_k, q'_k+1) as a bfloat16 pair, xp [M][K / 2]
 * each row's (x_k, x_k+1); one instruction adds x_k+1 q'_k+1, then x_k q'_k, to each lane (exact products, each
 * addition rounded: q4p_avx512_tile's two FMAs, bit for bit). */
#define AVX512BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))
AVX512BF16_TARGET static inline __attribute__((always_inline)) void q4p_bf16dot_tile(
        const uint32_t *tab, const uint32_t *Wp, const uint32_t *xp, const float *xs, int64_t K, int64_t N,
        int64_t n0, const int s0, const int S, int64_t i0, const int R, int round_out, float *y) {
    const int64_t G = K / 32, P = K / 2;
    __m512 acc[MT_Q4P][4], s[MT_Q4P][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < S; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < S; j++) s[r][j] = _mm512_setzero_ps();
        for (int64_t p = 16 * g; p < 16 * g + 16; p++) {
            __m512i w[4];
            for (int j = 0; j < S; j++) w[j] = _mm512_loadu_si512((const void *)(Wp + p * 16 * S + 16 * j));
            for (int r = 0; r < R; r++) {
                __m512i xv = _mm512_set1_epi32((int)xp[(i0 + r) * P + p]);
                for (int j = 0; j < S; j++) s[r][j] = _mm512_dpbf16_ps(s[r][j], (__m512bh)w[j], (__m512bh)xv);
            }
        }
        q4p_avx512_fold(tab + g * N + n0, xs, G, g, s0, S, i0, R, s, acc);
    }
    q4p_avx512_store((const __m512 (*)[4])acc, N, n0, s0, S, i0, R, round_out, y);
}

/* Slices s0 .. s0 + S - 1 of block n0 dequantized once: pairs (Wp, for q4p_bf16dot_tile) or float32 q' (W). */
AVX512_TARGET static inline __attribute__((always_inline)) void q4p_avx512_dequant_slices(
        const uint8_t *codes, int64_t K, const int B, int64_t n0, const int s0, const int S, float *W,
        uint32_t *Wp) {
    const int64_t half = B / 2;
    const uint8_t *cb = codes + n0 / B * K * half;
    uint32_t bits[16];  /* the bfloat16 of q - 8 for q = 0 .. 15 (exact) */
    for (int q = 0; q < 16; q++) { union { float f; uint32_t u; } c = {(float)(q - 8)}; bits[q] = c.u >> 16; }
    const __m512i pair_table = _mm512_loadu_si512((const void *)bits);
    for (int64_t k = 0; k < K; k += 2) {
        if (Wp) {
            __m512i c0[4], c1[4];
            q4p_avx512_codes(cb + k * half, B, s0, S, c0);
            q4p_avx512_codes(cb + (k + 1) * half, B, s0, S, c1);
            for (int j = 0; j < S; j++)
                _mm512_storeu_si512((void *)(Wp + k / 2 * 16 * S + 16 * j), _mm512_or_si512(
                    _mm512_permutexvar_epi32(c0[j], pair_table),
                    _mm512_slli_epi32(_mm512_permutexvar_epi32(c1[j], pair_table), 16)));
        } else {
            __m512 w[4];
            for (int64_t kk = k; kk < k + 2; kk++) {
                q4p_avx512_weights(cb + kk * half, B, s0, S, w);
                for (int j = 0; j < S; j++) _mm512_storeu_ps(W + kk * 16 * S + 16 * j, w[j]);
            }
        }
    }
}

/* The (B, s0, S) units: u 0 the whole block, 1 its low half, 2 its high half. */
#define Q4P_UNITS(CALL, b) \
    switch (u) { case 0: CALL(b, 0, b / 16); break; case 1: CALL(b, 0, b / 32); break; default: CALL(b, b / 32, b / 32); break; }

#define CALL_Q4P_DQ(b, s, n) q4p_avx512_dequant_slices(codes, K, b, n0, s, n, W, Wp)
AVX512_TARGET static void q4p_avx512_dequant(const uint8_t *codes, int64_t K, int B, int64_t n0, int u, float *W,
                                             uint32_t *Wp) {
    if (B == 64) { Q4P_UNITS(CALL_Q4P_DQ, 64) } else { Q4P_UNITS(CALL_Q4P_DQ, 32) }
}

#define CALL_Q4P_R(b, s, n) \
    switch (R) { case 1: CALL_Q4P(b, s, n, 1); break; case 2: CALL_Q4P(b, s, n, 2); break; \
                 default: CALL_Q4P(b, s, n, 3); break; }
#define CALL_Q4P(b, s, n, r) q4p_avx512_tile(codes, tab, W, xb, xs, K, N, b, n0, s, n, i0, r, round_out, y)
AVX512_TARGET static void q4p_avx512(const uint8_t *codes, const uint32_t *tab, const float *W, const float *xb,
                                     const float *xs, int64_t K, int64_t N, int B, int64_t n0, int u, int64_t i0,
                                     int R, int round_out, float *y) {
    if (B == 64) { Q4P_UNITS(CALL_Q4P_R, 64) } else { Q4P_UNITS(CALL_Q4P_R, 32) }
}
#undef CALL_Q4P
#define CALL_Q4P(b, s, n, r) q4p_bf16dot_tile(tab, Wp, xp, xs, K, N, n0, s, n, i0, r, round_out, y)
AVX512BF16_TARGET static void q4p_bf16dot(const uint32_t *tab, const uint32_t *Wp, const uint32_t *xp,
                                          const float *xs, int64_t K, int64_t N, int B, int64_t n0, int u,
                                          int64_t i0, int R, int round_out, float *y) {
    if (B == 64) { Q4P_UNITS(CALL_Q4P_R, 64) } else { Q4P_UNITS(CALL_Q4P_R, 32) }
}

/* Lane i: _mm512_reduce_add_ps(v[i]) for i < 16, bit for bit, in 30 shuffles and 15 additions rather than 16 x 7
 * operations: the same additions (lanes i + (i + 8), then + 4, then + 2, then + 1), done for the 16 vectors at
 * once by a transposed tree. */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 reduce_add16(const __m512 *v) {
    __m512 s[8], t[4], u[2];
    for (int p = 0; p < 8; p++)  /* s[p]: [v[2p] lanes 0-7 + 8-15 | v[2p + 1] likewise] */
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int q = 0; q < 4; q++)  /* t[q], 128-bit lane L: v[4q + L]'s 8 sums, halves added */
        t[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xDD));
    for (int h = 0; h < 2; h++)  /* u[h], lane L: [e0 + e2, e1 + e3] of v[8h + L], then of v[8h + 4 + L] */
        u[h] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * h], t[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * h], t[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane L, element e: the sum of v[4e + L] */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}

/* A q8 tile's outputs: each lane sum reduced by reduce_add16, times ws[n + c] when ws is not NULL, rounded to
 * bfloat16 when round_out, 16 outputs at a time (the scalar path's products and roundings, bit for bit). */
AVX512_TARGET static inline __attribute__((always_inline)) void q8b_avx512_store(
        __m512 (*acc)[MT_Q8B], const float *ws, int64_t n, const int C, int64_t i0, const int R, int64_t N,
        int round_out, float *y) {
    __m512 v[2 * 16];
    float sums[2 * 16];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) v[c * R + r] = acc[c][r];
    for (int i = C * R; i < (C * R > 16 ? 32 : 16); i++) v[i] = _mm512_setzero_ps();
    for (int h = 0; h < (C * R > 16 ? 2 : 1); h++) {
        __m512 out = reduce_add16(v + 16 * h);
        if (ws) {  /* lane i is output (c, r) = ((16 h + i) / R, (16 h + i) % R) */
            int lane_c[16];
            for (int i = 0; i < 16; i++) lane_c[i] = (16 * h + i) / R < C ? (16 * h + i) / R : 0;
            out = _mm512_mul_ps(out, _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)lane_c),
                                                           _mm512_maskz_loadu_ps((__mmask16)((1u << C) - 1), ws + n)));
        }
        if (round_out) out = round_bf16_512(out);
        _mm512_storeu_ps(sums + 16 * h, out);
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) y[(i0 + r) * N + n + c] = sums[c * R + r];
}

AVX512_TARGET static inline __attribute__((always_inline)) void q8b_avx512_tile(
        const int8_t *w, const float *ws, const float *W, const int from_tile, const float *xb, int64_t XS, int64_t n,
        const int C, int64_t i0, const int R, int64_t K, int64_t N, int round_out, float *y) {
    __m512 acc[NC_Q8B][MT_Q8B];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 xv[MT_Q8B];  /* each x load feeds C FMAs: 6 + 24 + 1 registers */
        for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_ps(xb + (i0 + r) * XS + k);
        for (int c = 0; c < C; c++) {
            __m512 wv;
            if (from_tile) {
                wv = _mm512_loadu_ps(W + c * K + k);
            } else {
                const int8_t *wp = w + (n + c) * K + k;
                if (!(k & 63)) {
                    _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T0);
                    _mm_prefetch((const char *)wp + PREFETCH_L2_BYTES, _MM_HINT_T1);
                }
                wv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wp))),
                                   _mm512_set1_ps(ws[n + c]));
            }
            for (int r = 0; r < R; r++) acc[c][r] = _mm512_fmadd_ps(xv[r], wv, acc[c][r]);
        }
    }
    q8b_avx512_store(acc, NULL, n, C, i0, R, N, round_out, y);
}

/* Weight rows n .. n1 - 1 dequantized once into W [n1 - n][K] float32: w * ws, exact in float32 (8 bits times a
 * bfloat16's 8), so the tile above reads the values it would compute. */
AVX512_TARGET static void q8b_avx512_dequant(const int8_t *w, const float *ws, int64_t n, int64_t n1, int64_t K,
                                             float *W) {
    for (int64_t c = 0; c < n1 - n; c++) {
        const int8_t *wp = w + (n + c) * K;
        const __m512 s = _mm512_set1_ps(ws[n + c]);
        for (int64_t k = 0; k < K; k += 16) {
            if (!(k & 63)) _mm_prefetch((const char *)wp + k + PREFETCH_L2_BYTES, _MM_HINT_T1);
            _mm512_storeu_ps(W + c * K + k, _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wp + k)))), s));
        }
    }
}

/* The (C, R) variants of a q8 tile, C weight rows and R x rows compile-time constants (registers). */
#define PD_TILE_CASES(CALL)                                                                                   \
    case 0: CALL(1, 1); break; case 1: CALL(1, 2); break; case 2: CALL(1, 3); break; case 3: CALL(1, 4); break; \
    case 4: CALL(2, 1); break; case 5: CALL(2, 2); break; case 6: CALL(2, 3); break; default: CALL(2, 4); break;

#define PD_TILE_FN(name, target, ...)                                                                        \
    target static void name(const int8_t *w, const float *ws, const float *xb, int64_t n, int C, int64_t i0,   \
                            int R, int64_t K, int64_t N, int round_out, float *y) {                          \
        switch (4 * (C - 1) + R - 1) { PD_TILE_CASES(__VA_ARGS__) }                                          \
    }
#define CALL_Q8B_AVX2(c, r) q8b_avx2_tile(w, ws, xb, K, n, c, i0, r, K, N, round_out, y)
PD_TILE_FN(q8b_avx2, AVX2_TARGET, CALL_Q8B_AVX2)

/* The AVX512 q8 tile takes up to NC_Q8B weight rows and MT_Q8B rows of x: (C, R) = (4, 6) holds 24
 * accumulators, and each x load feeds C FMAs (with (2, 8) the loads of x bounded the LM head at 32 rows to 55%
 * of the FMA peak). Each output's sum is the same whatever the tile: lanes over k in order, then
 * _mm512_reduce_add_ps. */
#define CALL_Q8B_AVX512(c, r)                                                                                  \
    if (W) q8b_avx512_tile(w, ws, W, 1, xb, K, n, c, i0, r, K, N, round_out, y);                               \
    else q8b_avx512_tile(w, ws, NULL, 0, xb, K, n, c, i0, r, K, N, round_out, y)
#define CALL_Q8B_AVX512_R(c)                                                                                   \
    switch (R) { case 1: CALL_Q8B_AVX512(c, 1); break; case 2: CALL_Q8B_AVX512(c, 2); break;                  \
                 case 3: CALL_Q8B_AVX512(c, 3); break; case 4: CALL_Q8B_AVX512(c, 4); break;                  \
                 case 5: CALL_Q8B_AVX512(c, 5); break; default: CALL_Q8B_AVX512(c, 6); break; }
AVX512_TARGET static void q8b_avx512(const int8_t *w, const float *ws, const float *W, const float *xb, int64_t n,
                                     int C, int64_t i0, int R, int64_t K, int64_t N, int round_out, float *y) {
    switch (C) { case 1: CALL_Q8B_AVX512_R(1) break; case 2: CALL_Q8B_AVX512_R(2) break;
                 case 3: CALL_Q8B_AVX512_R(3) break; default: CALL_Q8B_AVX512_R(4) break; }
}
/* q8 at level 3: each output y = ws[n] * reduce_add16(lanes), lane l summing, for every 32 inputs k0 in order,
 * x[k0 + 2l + 1] w[..] then x[k0 + 2l] w[..] (vdpbf16ps on x's and the row's bfloat16 pairs in natural order: w
 * in [-127, 127] is a bfloat16 value, its products with x exact). The row's codes are converted in registers,
 * or (from_tile) read from Wb, a block dequantized once to bfloat16, [C][K]: a compile-time choice, so that each
 * loop has only its own registers (one loop with both branches kept its x vectors on the stack: 1.24x the time
 * at 512 rows, one thread; the level-2 tile, split the same way, 1.06x). Not int8pack_mm's order: its sums
 * differ from levels 2 and 1 by float32 rounding (each level is batch invariant on its own). */
AVX512BF16_TARGET static inline __m512i q8b_bf16_weights(const int8_t *wp) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wp)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wp + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  /* elements 0-15: lo, 16-31: hi (exact: integers) */
}

AVX512BF16_TARGET static inline __attribute__((always_inline)) void q8b_bf16dot_tile(
        const int8_t *w, const float *ws, const uint16_t *Wb, const int from_tile, const uint16_t *xh, int64_t n,
        const int C, int64_t i0, const int R, int64_t K, int64_t N, int round_out, float *y) {
    __m512 acc[NC_Q8B][MT_Q8B];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i xv[MT_Q8B];
        for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_si512((const void *)(xh + (i0 + r) * K + k));
        for (int c = 0; c < C; c++) {
            __m512i wv;
            if (from_tile) {
                wv = _mm512_loadu_si512((const void *)(Wb + c * K + k));
            } else {
                const int8_t *wp = w + (n + c) * K + k;
                if (!(k & 63)) {
                    _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T0);
                    _mm_prefetch((const char *)wp + PREFETCH_L2_BYTES, _MM_HINT_T1);
                }
                wv = q8b_bf16_weights(wp);
            }
            for (int r = 0; r < R; r++) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], (__m512bh)wv, (__m512bh)xv[r]);
        }
    }
    q8b_avx512_store(acc, ws, n, C, i0, R, N, round_out, y);
}

/* Weight rows n .. n1 - 1 as bfloat16 into Wb [n1 - n][K] (exact). */
AVX512BF16_TARGET static void q8b_bf16_dequant(const int8_t *w, int64_t n, int64_t n1, int64_t K, uint16_t *Wb) {
    for (int64_t c = 0; c < n1 - n; c++) {
        const int8_t *wp = w + (n + c) * K;
        for (int64_t k = 0; k < K; k += 32) {
            if (!(k & 63)) _mm_prefetch((const char *)wp + k + PREFETCH_L2_BYTES, _MM_HINT_T1);
            _mm512_storeu_si512((void *)(Wb + c * K + k), q8b_bf16_weights(wp + k));
        }
    }
}

#define CALL_Q8B_BF16(c, r)                                                                                    \
    if (Wb) q8b_bf16dot_tile(w, ws, Wb, 1, xh, n, c, i0, r, K, N, round_out, y);                               \
    else q8b_bf16dot_tile(w, ws, NULL, 0, xh, n, c, i0, r, K, N, round_out, y)
#define CALL_Q8B_BF16_R(c)                                                                                     \
    switch (R) { case 1: CALL_Q8B_BF16(c, 1); break; case 2: CALL_Q8B_BF16(c, 2); break;                      \
                 case 3: CALL_Q8B_BF16(c, 3); break; default: CALL_Q8B_BF16(c, MT_Q8B3); break; }
AVX512BF16_TARGET static void q8b_bf16dot(const int8_t *w, const float *ws, const uint16_t *Wb, const uint16_t *xh,
                                          int64_t n, int C, int64_t i0, int R, int64_t K, int64_t N, int round_out,
                                          float *y) {
    switch (C) { case 1: CALL_Q8B_BF16_R(1) break; case 2: CALL_Q8B_BF16_R(2) break;
                 case 3: CALL_Q8B_BF16_R(3) break; default: CALL_Q8B_BF16_R(4) break; }
}
#endif

/* ------------------------------------------------------------------------------------------------ q4, int8 x */
/* Kind 0 (q4 with int8 x) reads the q4-bf16 kernels' weights: int4pack's layout (codes [N / B][K][B / 2], tab
 * [G][N]; section "bfloat16 x"), W[n, k] = q * d + m, m = z - 8 d. Each output channel of row i is, over the
 * groups g in order,
 *     y = fmaf((float)isum_g, d_g * dx_g, y);  y = fmaf(m_g, sx_g, y)         (from y = 0)
 * with isum_g = sum_j q[n, 32 g + j] * xq[32 g + j] exact (int32) and d_g * dx_g rounded once: the same bits on
 * every path, in any batch, on any number of threads. A unit's codes are first spread into a tile (q4i_tile) of
 * [K / 4][S][16 channels][4 inputs] bytes, each 32-bit lane one channel's codes at four consecutive inputs:
 * what vpdpbusd (four u8 x s8 products a lane, 64 an instruction: twice vdpbf16ps's) and AVX2's maddubs + madd
 * read, lanes over output channels. */
#define MT_Q4I 2
#define Q4I_TILE_ROWS 8  /* from this many rows of x a unit's codes are spread into a tile once a call (Zen 4,
                            VBMI: 4 and 6 rows 14% and 3% faster spread in registers every pass, 8 and 11 not) */
#define MT_Q4I_AVX2 2 /* AVX2 x rows per pass straight from the codes (a piece: four 8-channel sets a row) */
#define MT_Q4I_AVX2_TILE 4 /* AVX2 x rows per pass over a tile (one slice, two 8-channel halves; quant_block's
                              blocks) */
#ifndef Q4I_AVX2_TILE_ROWS
#define Q4I_AVX2_TILE_ROWS 10  /* AVX2: the tile from 10 rows (AVX2-only Zen 4, 2 threads, the 30 layers' matmuls
                                 from memory: straight from the codes 0.60x / 0.82x / 0.95x the tile's time at 3 / 5 /
                                 8 rows, 1.07x at 12) */
#endif

/* The tile of slices s0 .. s0 + S - 1 of block n0: T[((p S + j) 16 + c) 4 + t] = the code of channel
 * n0 + 16 (s0 + j) + c at input 4 p + t. */
static void q4i_tile_scalar(const uint8_t *codes, int64_t K, int B, int64_t n0, int s0, int S, uint8_t *T) {
    const int64_t half = B / 2;
    const uint8_t *cb = codes + n0 / B * K * half;
    for (int64_t p = 0; p < K / 4; p++)
        for (int j = 0; j < S; j++)
            for (int c = 0; c < 16; c++) {
                const int ch = 16 * (s0 + j) + c;
                for (int t = 0; t < 4; t++) {
                    const uint8_t b = cb[(4 * p + t) * half + ch % half];
                    T[((p * S + j) * 16 + c) * 4 + t] = (uint8_t)(ch >= half ? b >> 4 : b & 15);
                }
            }
}

#if PD_X86
/* The codes of a B = 64 block's four slices at inputs 4 p .. 4 p + 3 (cb: the block's codes) in q4i_tile_scalar's
 * order: each input's 32 code bytes broadcast to both halves of a register, the upper half's high nibbles taken
 * (128-bit lane j: slice j's 16 codes), the four inputs interleaved by unpacks (lane j of o[i]: channels
 * 4 i .. 4 i + 3 of slice j), then the 4 x 4 lanes transposed (slice j: lane j of o[0] .. o[3]). */
AVX512_TARGET static inline __attribute__((always_inline)) void q4i_slices_avx512(const uint8_t *cb, int64_t p,
                                                                                 __m512i *slice) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i r[4];
    for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(cb + (4 * p + t) * 32)));
        r[t] = _mm512_and_si512(_mm512_mask_srli_epi16(v, (__mmask32)0xFFFF0000u, v, 4), low);
    }
    const __m512i a = _mm512_unpacklo_epi8(r[0], r[1]), b = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i c = _mm512_unpacklo_epi8(r[2], r[3]), d = _mm512_unpackhi_epi8(r[2], r[3]);
    const __m512i o0 = _mm512_unpacklo_epi16(a, c), o1 = _mm512_unpackhi_epi16(a, c);
    const __m512i o2 = _mm512_unpacklo_epi16(b, d), o3 = _mm512_unpackhi_epi16(b, d);
    const __m512i t0 = _mm512_shuffle_i64x2(o0, o1, 0x44), t1 = _mm512_shuffle_i64x2(o2, o3, 0x44);
    const __m512i t2 = _mm512_shuffle_i64x2(o0, o1, 0xEE), t3 = _mm512_shuffle_i64x2(o2, o3, 0xEE);
    slice[0] = _mm512_shuffle_i64x2(t0, t1, 0x88), slice[1] = _mm512_shuffle_i64x2(t0, t1, 0xDD);
    slice[2] = _mm512_shuffle_i64x2(t2, t3, 0x88), slice[3] = _mm512_shuffle_i64x2(t2, t3, 0xDD);
}

/* The same four slices by AVX512-VBMI's two-table byte permute: the four inputs' 128 code bytes are two
 * registers, and one vpermt2b gathers byte c of each input into channel c's lane for slices 0 and 2 (bytes
 * 0 .. 15), another for slices 1 and 3 (bytes 16 .. 31); then the low and high nibbles. 10 instructions where
 * q4i_slices_avx512 takes 28. */
#define VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma")))
VBMI_TARGET static inline __attribute__((always_inline)) void q4i_slices_vbmi(const uint8_t *cb, int64_t p,
                                                                             __m512i *slice) {
    static const int8_t gather[2][64] = {  /* [pair][4 c + t] = 32 t + c (+ 16 for slices 1 and 3) */
#define Q4I_ROW(c, o) 0 + (c) + (o), 32 + (c) + (o), 64 + (c) + (o), 96 + (c) + (o)
#define Q4I_ROWS(o) Q4I_ROW(0, o), Q4I_ROW(1, o), Q4I_ROW(2, o), Q4I_ROW(3, o), Q4I_ROW(4, o), Q4I_ROW(5, o), \
    Q4I_ROW(6, o), Q4I_ROW(7, o), Q4I_ROW(8, o), Q4I_ROW(9, o), Q4I_ROW(10, o), Q4I_ROW(11, o), Q4I_ROW(12, o), \
    Q4I_ROW(13, o), Q4I_ROW(14, o), Q4I_ROW(15, o)
        {Q4I_ROWS(0)}, {Q4I_ROWS(16)}};
#undef Q4I_ROWS
#undef Q4I_ROW
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i a = _mm512_loadu_si512((const void *)(cb + 128 * p));
    const __m512i b = _mm512_loadu_si512((const void *)(cb + 128 * p + 64));
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_permutex2var_epi8(a, _mm512_loadu_si512((const void *)gather[h]), b);
        slice[h] = _mm512_and_si512(v, low);
        slice[h + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

typedef void (*q4i_slices_fn)(const uint8_t *cb, int64_t p, __m512i *slice);

/* q4i_tile_scalar's bytes for B = 64 (slices: q4i_slices_avx512 or q4i_slices_vbmi, inlined). */
AVX512_TARGET static inline __attribute__((always_inline)) void q4i_tile_b64(
        const uint8_t *codes, int64_t K, int64_t n0, int s0, int S, uint8_t *T, q4i_slices_fn slices) {
    const uint8_t *cb = codes + n0 / 64 * K * 32;
    for (int64_t p = 0; p < K / 4; p++) {
        _mm_prefetch((const char *)(cb + 128 * p) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512i slice[4];
        slices(cb, p, slice);
        for (int j = 0; j < S; j++) _mm512_storeu_si512((void *)(T + (p * S + j) * 64), slice[s0 + j]);
    }
}

AVX512_TARGET static void q4i_tile_avx512(const uint8_t *codes, int64_t K, int64_t n0, int s0, int S, uint8_t *T) {
    q4i_tile_b64(codes, K, n0, s0, S, T, q4i_slices_avx512);
}

VBMI_TARGET static void q4i_tile_vbmi(const uint8_t *codes, int64_t K, int64_t n0, int s0, int S, uint8_t *T) {
    q4i_tile_b64(codes, K, n0, s0, S, T, q4i_slices_vbmi);
}

/* Channels c0 .. c0 + 16 S - 1 (the tile T's slices; T NULL: slices s0 .. s0 + S - 1 of the B = 64 block whose
 * codes are cb, spread in registers) against rows i0 .. i0 + R - 1 by vpdpbusd. */
VNNI_TARGET static inline __attribute__((always_inline)) void q4i_vnni_tile(
        const uint8_t *T, const uint8_t *cb, const int s0, const uint32_t *tab, const int8_t *xq, const float *dx,
        const float *sx, int64_t K, int64_t N, int64_t c0, const int S, int64_t i0, const int R, float *y,
        q4i_slices_fn slices) {
    const int64_t G = K / 32;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[MT_Q4I][4];
    __m512i s[MT_Q4I][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < S; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < S; j++) s[r][j] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {  /* a constant count: unrolled whole, the sums stay in their registers */
            const int64_t p = 8 * g + t;
            __m512i w[4], slice[4];
            if (T) {
                for (int j = 0; j < S; j++) w[j] = _mm512_loadu_si512((const void *)(T + (p * S + j) * 64));
            } else {
                if (!(p & 1)) _mm_prefetch((const char *)(cb + 128 * p) + PREFETCH_BYTES, _MM_HINT_T0);
                slices(cb, p, slice);
                for (int j = 0; j < S; j++) w[j] = slice[s0 + j];
            }
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, xq + (i0 + r) * K + 4 * p, 4);
                const __m512i xv = _mm512_set1_epi32(x4);
                for (int j = 0; j < S; j++) s[r][j] = _mm512_dpbusd_epi32(s[r][j], w[j], xv);
            }
        }
        for (int j = 0; j < S; j++) {
            const __m512i t = _mm512_loadu_si512((const void *)(tab + g * N + c0 + 16 * j));
            const __m512 d = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
            const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), d, _mm512_castsi512_ps(_mm512_and_si512(t, high)));
            for (int r = 0; r < R; r++) {
                const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(dx[(i0 + r) * G + g]));
                acc[r][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(i0 + r) * G + g]),
                                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][j]), sc, acc[r][j]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < S; j++) _mm512_storeu_ps(y + (i0 + r) * N + c0 + 16 * j, acc[r][j]);
}

#define CALL_Q4I_VNNI(s, r) q4i_vnni_tile(T, cb, s0, tab, xq, dx, sx, K, N, c0, s, i0, r, y, SLICES)
#define CALL_Q4I_VNNI_R(s) \
    switch (R) { case 1: CALL_Q4I_VNNI(s, 1); break; default: CALL_Q4I_VNNI(s, 2); break; }
#define Q4I_VNNI_FN(name, target)                                                                              \
    target static void name(const uint8_t *T, const uint8_t *cb, int s0, const uint32_t *tab, const int8_t *xq, \
                            const float *dx, const float *sx, int64_t K, int64_t N, int64_t c0, int S, int64_t i0, \
                            int R, float *y) {                                                                 \
        switch (S) { case 1: CALL_Q4I_VNNI_R(1) break; case 2: CALL_Q4I_VNNI_R(2) break;                      \
                     default: CALL_Q4I_VNNI_R(4) break; }                                                      \
    }
#define SLICES q4i_slices_avx512
Q4I_VNNI_FN(q4i_vnni, VNNI_TARGET)
#undef SLICES
#define SLICES q4i_slices_vbmi
Q4I_VNNI_FN(q4i_vnni_vbmi, VBMI_TARGET)
#undef SLICES

/* One slice (channels c0 .. c0 + 15, two 8-lane halves) against rows i0 .. i0 + R - 1: maddubs gives each
 * 16-bit lane two products (at most 2 x 15 x 127: no saturation), madd with ones the lane's four. */
/* Slice js (16 channels) of a block's codes (cb; B channels, half = B / 2 bytes an input) at inputs 4 p .. 4 p + 3
 * in q4i_tile_scalar's order: w[0] channels 0-7, w[1] 8-15, four bytes (the four inputs' codes) a channel. A
 * 4 x 16 byte transpose by unpacks. */
AVX2_TARGET static inline __attribute__((always_inline)) void q4i_slice_avx2(
        const uint8_t *cb, int64_t half, const int B, const int js, int64_t p, __m256i *w) {
    const __m128i shift = _mm_cvtsi32_si128(Q4P_SHIFT(B, js)), low = _mm_set1_epi8(15);
    __m128i r[4];
    for (int t = 0; t < 4; t++)
        r[t] = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(cb + (4 * p + t) * half + Q4P_OFF(B, js))),
                                           shift), low);
    const __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpackhi_epi8(r[0], r[1]);
    const __m128i b0 = _mm_unpacklo_epi8(r[2], r[3]), b1 = _mm_unpackhi_epi8(r[2], r[3]);
    w[0] = _mm256_set_m128i(_mm_unpackhi_epi16(a0, b0), _mm_unpacklo_epi16(a0, b0));
    w[1] = _mm256_set_m128i(_mm_unpackhi_epi16(a1, b1), _mm_unpacklo_epi16(a1, b1));
}

/* q4i_tile_scalar's bytes by q4i_slice_avx2 (either block size). */
AVX2_TARGET static void q4i_tile_avx2(const uint8_t *codes, int64_t K, int B, int64_t n0, int s0, int S, uint8_t *T) {
    const uint8_t *cb = codes + n0 / B * K * (B / 2);
    for (int64_t p = 0; p < K / 4; p++)
        for (int j = 0; j < S; j++) {
            __m256i w[2];
            q4i_slice_avx2(cb, B / 2, B, s0 + j, p, w);
            _mm256_storeu_si256((__m256i *)(T + (p * S + j) * 64), w[0]);
            _mm256_storeu_si256((__m256i *)(T + (p * S + j) * 64 + 32), w[1]);
        }
}

/* One slice (16 channels from c, two 8-lane halves) of a tile against a block of 4 rows of x, interleaved (xi:
 * inputs 4 p .. 4 p + 3 of the block's rows 0-3 at xi[16 p ..], di / si: dx and sx of group g at [4 g ..]; rows
 * past M zero), R of them stored from y (row i0's channel c). t points at the slice's 64 bytes of pass 0, the
 * next pass `stride` bytes on. maddubs gives each 16-bit lane two products (at most 2 x 15 x 127 = 3,810), and a
 * group's 8 passes add up in int16 (at most 30,480: no saturation); madd with ones then gives each channel its
 * int32 sum, exact as every integer sum is. The float totals wait in y between groups (exact: a float32 store).
 * Interleaved, a pass reads x by one pointer (with four row pointers GCC spilled), and its sums stay in registers
 * (PD_KEEP). */
AVX2_TARGET static inline __attribute__((always_inline)) void q4i_avx2_tile(
        const uint8_t *t, const int64_t stride, const uint32_t *tab, const int8_t *xi, const float *di,
        const float *si, int64_t G, int64_t N, const int R, float *y) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < G; g++, xi += 128, tab += N) {
        __m256i s[4][2];
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++, t += stride) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)t);
            const __m256i w1 = _mm256_load_si256((const __m256i *)(t + 32));
            for (int r = 0; r < 4; r++) {
                int32_t x4;
                memcpy(&x4, xi + 16 * q + 4 * r, 4);
                const __m256i xv = _mm256_set1_epi32(x4);
                const __m256i p0 = _mm256_maddubs_epi16(w0, xv), p1 = _mm256_maddubs_epi16(w1, xv);
                s[r][0] = q ? _mm256_add_epi16(s[r][0], p0) : p0;
                s[r][1] = q ? _mm256_add_epi16(s[r][1], p1) : p1;
                PD_KEEP(s[r][0]);
                PD_KEEP(s[r][1]);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256i tv = _mm256_loadu_si256((const __m256i *)(tab + 8 * h));
            const __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(tv, 16));
            const __m256 m = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), d, _mm256_castsi256_ps(_mm256_and_si256(tv, high)));
            for (int r = 0; r < R; r++) {
                const __m256 sc = _mm256_mul_ps(d, _mm256_set1_ps(di[4 * g + r]));
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
                float *yp = y + r * N + 8 * h;
                const __m256 acc = g ? _mm256_loadu_ps(yp) : _mm256_setzero_ps();
                _mm256_storeu_ps(yp, _mm256_fmadd_ps(m, _mm256_set1_ps(si[4 * g + r]), _mm256_fmadd_ps(isum, sc, acc)));
            }
        }
    }
}

/* Straight from the codes (no tile): piece q of a block (code bytes 16 q .. 16 q + 15 of each input's B / 2; their
 * low nibbles are channels cl .. cl + 15 = n0 + 16 q .., their high ones ch = cl + B / 2 ..) against rows i0 .. i0
 * + R - 1, the low nibbles' channels when lo, the high ones' when hi. A pass reads inputs 4 p .. 4 p + 3 as two
 * registers [input 0 | input 1] and [2 | 3] (one load each for B = 32, whose inputs are 16 bytes apart); a byte
 * unpack pairs input 0 with 2 in 128-bit lane 0 and 1 with 3 in lane 1, 8 channels at a time, and maddubs against
 * x's pairs (x0, x2 | x1, x3) gives each 16-bit lane two products: 12 operations (loads included) spread 128 codes,
 * where q4i_slice_avx2 takes 22 for 64. A group's 8 passes add up in int16 (at most 8 x 3,810), then each channel's
 * two lanes are widened and added: the tile's exact int32 sums, so the same bits. The float totals wait in y
 * between groups (exact: a float32 store). */
AVX2_TARGET static inline __attribute__((always_inline)) void q4i_avx2_piece(
        const uint8_t *cb, const int64_t half, const int q, const int lo, const int hi, const uint32_t *tab,
        const int8_t *xq, const float *dx, const float *sx, int64_t K, int64_t N, int64_t cl, int64_t i0, const int R,
        float *y) {
    const int64_t G = K / 32;
    const __m256i low = _mm256_set1_epi8(15), high = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i pairs = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                           1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
    const int k0 = lo ? 0 : 2, k1 = hi ? 4 : 2;  /* s[r][k]: k / 2 the nibble, k % 2 channels 0-7 or 8-15 */
    for (int64_t g = 0; g < G; g++) {
        __m256i s[MT_Q4I_AVX2][4];
        for (int r = 0; r < R; r++)
            for (int k = k0; k < k1; k++) s[r][k] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int64_t p = 8 * g; p < 8 * g + 8; p++) {
            const uint8_t *b = cb + 4 * p * half + 16 * q;
            _mm_prefetch((const char *)b + PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i a = half == 16 ? _mm256_loadu_si256((const __m256i *)b)
                                         : _mm256_loadu2_m128i((const __m128i *)(b + half), (const __m128i *)b);
            const __m256i c = half == 16 ? _mm256_loadu_si256((const __m256i *)(b + 32))
                                         : _mm256_loadu2_m128i((const __m128i *)(b + 3 * half),
                                                               (const __m128i *)(b + 2 * half));
            __m256i w[4];
            if (lo) {
                const __m256i al = _mm256_and_si256(a, low), cl4 = _mm256_and_si256(c, low);
                w[0] = _mm256_unpacklo_epi8(al, cl4), w[1] = _mm256_unpackhi_epi8(al, cl4);
            }
            if (hi) {
                const __m256i ah = _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
                const __m256i ch4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
                w[2] = _mm256_unpacklo_epi8(ah, ch4), w[3] = _mm256_unpackhi_epi8(ah, ch4);
            }
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, xq + (i0 + r) * K + 4 * p, 4);
                const __m256i xv = _mm256_shuffle_epi8(_mm256_set1_epi32(x4), pairs);
                for (int k = k0; k < k1; k++) {
                    s[r][k] = _mm256_add_epi16(s[r][k], _mm256_maddubs_epi16(w[k], xv));
                    PD_KEEP(s[r][k]);
                }
            }
        }
        for (int k = k0; k < k1; k++) {
            const int64_t c0 = cl + (k / 2) * half + 8 * (k % 2);
            const __m256i t = _mm256_loadu_si256((const __m256i *)(tab + g * N + c0));
            const __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(t, 16));
            const __m256 m = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), d, _mm256_castsi256_ps(_mm256_and_si256(t, high)));
            for (int r = 0; r < R; r++) {
                const __m256i isum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s[r][k])),
                                                      _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s[r][k], 1)));
                const __m256 sc = _mm256_mul_ps(d, _mm256_set1_ps(dx[(i0 + r) * G + g]));
                float *yp = y + (i0 + r) * N + c0;
                const __m256 acc = g ? _mm256_loadu_ps(yp) : _mm256_setzero_ps();
                _mm256_storeu_ps(yp, _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(i0 + r) * G + g]),
                                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc)));
            }
        }
    }
}

/* Rows i0 .. i0 + R - 1 over the unit's slices s0 .. s0 + S - 1 of a block of B channels (n0 its first): from its
 * tile T, or (T NULL) straight from its codes cb, piece by piece (slice j: piece Q4P_OFF / 16, nibble
 * Q4P_SHIFT / 4; a unit holds both nibbles of its pieces, or one nibble of every piece). */
AVX2_TARGET static void q4i_avx2(const uint8_t *T, const uint8_t *cb, int B, int64_t n0, int s0, const uint32_t *tab,
                                 const int8_t *xq, const float *dx, const float *sx, const int8_t *xi,
                                 const float *di, const float *si, int64_t K, int64_t N, int S, int64_t i0, int R,
                                 float *y) {
    const int64_t c0 = n0 + 16 * s0;
    if (T) {
        const int64_t G = K / 32;
        const int8_t *xb = xi + i0 * K;
        const float *db = di + i0 * G, *sb = si + i0 * G;
        for (int j = 0; j < S; j++) {
            const uint8_t *t = T + 64 * j;
            const uint32_t *tj = tab + c0 + 16 * j;
            float *yj = y + i0 * N + c0 + 16 * j;
            switch (R) {
            case 1: q4i_avx2_tile(t, 64 * S, tj, xb, db, sb, G, N, 1, yj); break;
            case 2: q4i_avx2_tile(t, 64 * S, tj, xb, db, sb, G, N, 2, yj); break;
            case 3: q4i_avx2_tile(t, 64 * S, tj, xb, db, sb, G, N, 3, yj); break;
            default: q4i_avx2_tile(t, 64 * S, tj, xb, db, sb, G, N, 4, yj); break;
            }
        }
        return;
    }
    const int half = B / 2, both = S == B / 16, nib = Q4P_SHIFT(B, s0) / 4;
    for (int q = 0; q < half / 16; q++) {
        const int64_t cl = n0 + 16 * q;
        if (both && R == 1) q4i_avx2_piece(cb, half, q, 1, 1, tab, xq, dx, sx, K, N, cl, i0, 1, y);
        else if (both) q4i_avx2_piece(cb, half, q, 1, 1, tab, xq, dx, sx, K, N, cl, i0, 2, y);
        else if (!nib && R == 1) q4i_avx2_piece(cb, half, q, 1, 0, tab, xq, dx, sx, K, N, cl, i0, 1, y);
        else if (!nib) q4i_avx2_piece(cb, half, q, 1, 0, tab, xq, dx, sx, K, N, cl, i0, 2, y);
        else if (R == 1) q4i_avx2_piece(cb, half, q, 0, 1, tab, xq, dx, sx, K, N, cl, i0, 1, y);
        else q4i_avx2_piece(cb, half, q, 0, 1, tab, xq, dx, sx, K, N, cl, i0, 2, y);
    }
}
#endif

/* The contract's arithmetic, one output at a time (channel c0 + c of the tile, row i). */
static void q4i_scalar(const uint8_t *T, const uint32_t *tab, const int8_t *xq, const float *dx, const float *sx,
                       int64_t K, int64_t N, int64_t c0, int S, int c, int64_t i, float *y) {
    const int64_t G = K / 32;
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        int32_t isum = 0;
        for (int64_t p = 8 * g; p < 8 * g + 8; p++)
            for (int t = 0; t < 4; t++)
                isum += T[((p * S + c / 16) * 16 + c % 16) * 4 + t] * xq[i * K + 4 * p + t];
        const uint32_t tv = tab[g * N + c0 + c];
        const float d = bf16_lo(tv), m = bf16_hi(tv) - 8.0f * d;
        acc = fmaf(m, sx[i * G + g], fmaf((float)isum, d * dx[i * G + g], acc));
    }
    *y = acc;
}
/* ------------------------------------------------------------------------------------------------ q8, int8 x */
/* Kind 1 (q8 with int8 x): w int8 [N, K] row-major, ws [N]. Each output channel n of row i is, over the groups g
 * in order,
 *     y = fmaf((float)isum_g, dx_g, y)   (from y = 0),   then y = ws[n] * y
 * with isum_g = sum_j w[n, 32 g + j] * xq[32 g + j] exact (int32): the same bits on every path, in any batch, on
 * any number of threads. Units of NB_Q8I output channels are spread into a tile as for q4 ([K / 4][S][16][4]
 * bytes: one channel's weights at four consecutive inputs a 32-bit lane), as w ^ 0x80 = w + 128 unsigned for
 * vpdpbusd (whose sum, started from -128 * sumq_g, is isum_g), as w itself elsewhere (AVX2 multiplies |w| by
 * x with w's sign, pairs of products within int16, or from Q8I_AVX2_WIDE_ROWS rows widens both to int16). */
#define NB_Q8I 64     /* output channels per unit (the last may be partial) */
#define Q8I_AVX2_WIDE_ROWS 4  /* AVX2: from 4 rows of x, q8i_avx2_tile widens (0.88-0.95x the time at 4-128 rows; below,
                                 its weights' widening is not shared by rows enough) */
#define MT_Q8I_AVX2 4 /* AVX2 x rows per pass (one slice, two 8-channel halves; int32 sums) */

/* Channels n0 .. n0 + 16 S - 1 (those past N as zero weights) into T, each byte w ^ flip. */
static void q8i_tile_scalar(const int8_t *w, int64_t K, int64_t N, int64_t n0, int S, uint8_t flip, uint8_t *T) {
    for (int64_t p = 0; p < K / 4; p++)
        for (int j = 0; j < S; j++)
            for (int c = 0; c < 16; c++) {
                const int64_t n = n0 + 16 * j + c;
                for (int t = 0; t < 4; t++)
                    T[((p * S + j) * 16 + c) * 4 + t] = (uint8_t)((n < N ? (uint8_t)w[n * K + 4 * p + t] : 0) ^ flip);
            }
}

#if PD_X86
/* q8i_tile_scalar with flip 0x80, 16 channels x 16 inputs' dwords at a time: a 16 x 16 transpose of 32-bit
 * words (dword unpacks, then qword unpacks: u[i][m] lane L holds word 4 L + m of rows 4 i .. 4 i + 3, then the
 * 4 x 4 lanes of each m transposed). */
AVX512_TARGET static void q8i_tile_avx512(const int8_t *w, int64_t K, int64_t N, int64_t n0, int S, uint8_t *T) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t Q = K / 4;  /* dwords a row */
    for (int j = 0; j < S; j++)
        for (int64_t q0 = 0; q0 < Q; q0 += 16) {
            const int cnt = Q - q0 < 16 ? (int)(Q - q0) : 16;
            const __mmask16 km = (__mmask16)((1u << cnt) - 1);
            /* The next 16 rows (16 K contiguous bytes, the next slice's or unit's) into L1 by Q / 16 parts of
             * 1 KiB: 16 rows read a line at a time each are 16 streams the hardware prefetcher does not follow
             * (the LM head at one row 2.6 ms without, on Zen 4). */
            const char *ahead = (const char *)(w + (n0 + 16 * (j + 1)) * K) + 64 * q0;
            for (int l = 0; l < 16; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
            __m512i r[16], t[16], u[16];
            for (int c = 0; c < 16; c++) {
                const int64_t n = n0 + 16 * j + c;
                r[c] = n < N ? _mm512_maskz_loadu_epi32(km, w + n * K + 4 * q0) : _mm512_setzero_si512();
            }
            for (int i = 0; i < 8; i++) {
                t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
            }
            for (int i = 0; i < 4; i++) {
                u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
                u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
                u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
                u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
            }
            for (int m = 0; m < 4; m++) {
                const __m512i a = u[m], b = u[4 + m], c = u[8 + m], d = u[12 + m];
                const __m512i t0 = _mm512_shuffle_i64x2(a, b, 0x44), t1 = _mm512_shuffle_i64x2(c, d, 0x44);
                const __m512i t2 = _mm512_shuffle_i64x2(a, b, 0xEE), t3 = _mm512_shuffle_i64x2(c, d, 0xEE);
                const __m512i o[4] = {_mm512_shuffle_i64x2(t0, t1, 0x88), _mm512_shuffle_i64x2(t0, t1, 0xDD),
                                      _mm512_shuffle_i64x2(t2, t3, 0x88), _mm512_shuffle_i64x2(t2, t3, 0xDD)};
                for (int L = 0; L < 4; L++)
                    if (4 * L + m < cnt)
                        _mm512_storeu_si512((void *)(T + ((q0 + 4 * L + m) * S + j) * 64),
                                            _mm512_xor_si512(o[L], flip));
            }
        }
}

/* Channels n0 .. n0 + 16 S - 1 (the tile's slices; those past N not stored) against rows i0 .. i0 + R - 1. */
VNNI_TARGET static inline __attribute__((always_inline)) void q8i_vnni_tile(
        const uint8_t *T, const float *ws, const int8_t *xq, const float *dx, const int32_t *sq, int64_t K,
        int64_t N, int64_t n0, const int S, int64_t i0, const int R, float *y) {
    const int64_t G = K / 32;
    __m512 acc[MT_Q4I][4];
    __m512i s[MT_Q4I][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < S; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < R; r++) {
            const __m512i corr = _mm512_set1_epi32(-128 * sq[(i0 + r) * G + g]);
            for (int j = 0; j < S; j++) s[r][j] = corr;
        }
        for (int t = 0; t < 8; t++) {  /* a constant count: unrolled whole, the sums stay in their registers */
            const int64_t p = 8 * g + t;
            __m512i wv[4];
            for (int j = 0; j < S; j++) wv[j] = _mm512_loadu_si512((const void *)(T + (p * S + j) * 64));
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, xq + (i0 + r) * K + 4 * p, 4);
                const __m512i xv = _mm512_set1_epi32(x4);
                for (int j = 0; j < S; j++) s[r][j] = _mm512_dpbusd_epi32(s[r][j], wv[j], xv);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(dx[(i0 + r) * G + g]);
            for (int j = 0; j < S; j++) acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][j]), d, acc[r][j]);
        }
    }
    for (int j = 0; j < S; j++) {
        const int64_t n = n0 + 16 * j;
        const __mmask16 m = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
        const __m512 scale = _mm512_maskz_loadu_ps(m, ws + n);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (i0 + r) * N + n, m, _mm512_mul_ps(acc[r][j], scale));
    }
}

#define CALL_Q8I_VNNI(s, r) q8i_vnni_tile(T, ws, xq, dx, sq, K, N, n0, s, i0, r, y)
#define CALL_Q8I_VNNI_R(s) \
    switch (R) { case 1: CALL_Q8I_VNNI(s, 1); break; default: CALL_Q8I_VNNI(s, 2); break; }
VNNI_TARGET static void q8i_vnni(const uint8_t *T, const float *ws, const int8_t *xq, const float *dx,
                                 const int32_t *sq, int64_t K, int64_t N, int64_t n0, int S, int64_t i0, int R,
                                 float *y) {
    switch (S) { case 1: CALL_Q8I_VNNI_R(1) break; case 2: CALL_Q8I_VNNI_R(2) break;
                 case 3: CALL_Q8I_VNNI_R(3) break; default: CALL_Q8I_VNNI_R(4) break; }
}

/* q8i_tile_scalar's bytes (flip 0: the AVX2 kernel reads signed weights) by two 8 x 8 transposes of 32-bit words
 * per 16 rows and 8 words, the next 16 rows prefetched as q8i_tile_avx512 does. */
AVX2_TARGET static void q8i_tile_avx2(const int8_t *w, int64_t K, int64_t N, int64_t n0, int S, uint8_t *T) {
    const int64_t Q = K / 4;  /* words a row */
    for (int j = 0; j < S; j++)
        for (int64_t q0 = 0; q0 < Q; q0 += 8) {
            const int cnt = Q - q0 < 8 ? (int)(Q - q0) : 8;
            const __m256i km = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const char *ahead = (const char *)(w + (n0 + 16 * (j + 1)) * K) + 64 * q0;
            for (int l = 0; l < 8; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {  /* channels 8 h .. 8 h + 7 of the slice */
                __m256i r[8], t[8], u[8];
                for (int c = 0; c < 8; c++) {
                    const int64_t n = n0 + 16 * j + 8 * h + c;
                    r[c] = n < N ? _mm256_maskload_epi32((const int *)(w + n * K + 4 * q0), km)
                                 : _mm256_setzero_si256();
                }
                for (int i = 0; i < 4; i++) {
                    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
                    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
                }
                for (int i = 0; i < 2; i++) {
                    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
                    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
                    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
                    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
                }
                for (int m = 0; m < 4; m++) {  /* words m and 4 + m of the 8 rows */
                    if (m < cnt)
                        _mm256_storeu_si256((__m256i *)(T + ((q0 + m) * S + j) * 64 + 32 * h),
                                            _mm256_permute2x128_si256(u[m], u[4 + m], 0x20));
                    if (4 + m < cnt)
                        _mm256_storeu_si256((__m256i *)(T + ((q0 + 4 + m) * S + j) * 64 + 32 * h),
                                            _mm256_permute2x128_si256(u[m], u[4 + m], 0x31));
                }
            }
        }
}

/* One slice (channels n0 + 16 j .., two 8-lane halves) against rows i0 .. i0 + R - 1, the tile holding w, its
 * int32 sums by one of two ways (the same sums, so the same bits):
 * - not wide: |w| times x with w's sign by maddubs (a 16-bit lane's two products reach 2 x 127 x 127), madd into
 *   int32: three instructions on the ports maddubs, madd and the FMAs share per 32 products (bench/avx2_ports.c);
 * - wide (from Q8I_AVX2_WIDE_ROWS rows): each weight byte widened to int16 in registers (a 32-bit lane's even
 *   bytes, inputs 0 and 2, by two shifts, the odd ones by one: shifts run beside maddubs' ports) against x's pairs
 *   widened once a call (xw, quant_widen_one), vpmaddwd 16 products an instruction: two such instructions per 32
 *   products. Below that many rows the weights' widening is not shared by rows enough. */
AVX2_TARGET static inline __attribute__((always_inline)) void q8i_avx2_tile(
        const uint8_t *T, const int S, const int j, const float *ws, const int8_t *xq, const uint32_t *xw,
        const float *dx, int64_t K, int64_t N, int64_t n0, int64_t i0, const int R, const int wide, float *y) {
    const int64_t G = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[MT_Q8I_AVX2][16];  /* the float totals between groups (exact: a float32 store) */
    for (int64_t g = 0; g < G; g++) {
        __m256i s[MT_Q8I_AVX2][2];
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            const int64_t p = 8 * g + q;
            const uint8_t *tp = T + (p * S + j) * 64;
            __m256i w[2], e[2], o[2];
            for (int h = 0; h < 2; h++) {
                w[h] = _mm256_loadu_si256((const __m256i *)(tp + 32 * h));
                if (wide) {
                    e[h] = _mm256_srai_epi16(_mm256_slli_epi16(w[h], 8), 8);  /* inputs 0 and 2 of each channel */
                    o[h] = _mm256_srai_epi16(w[h], 8);                        /* inputs 1 and 3 */
                } else {
                    e[h] = _mm256_abs_epi8(w[h]);
                }
            }
            for (int r = 0; r < R; r++) {
                __m256i t[2];
                if (wide) {
                    const uint32_t *xr = xw + (i0 + r) * (K / 2) + 2 * p;
                    const __m256i xe = _mm256_set1_epi32((int)xr[0]), xo = _mm256_set1_epi32((int)xr[1]);
                    for (int h = 0; h < 2; h++)
                        t[h] = _mm256_add_epi32(_mm256_madd_epi16(e[h], xe), _mm256_madd_epi16(o[h], xo));
                } else {
                    int32_t x4;
                    memcpy(&x4, xq + (i0 + r) * K + 4 * p, 4);
                    const __m256i xv = _mm256_set1_epi32(x4);
                    for (int h = 0; h < 2; h++)
                        t[h] = _mm256_madd_epi16(_mm256_maddubs_epi16(e[h], _mm256_sign_epi8(xv, w[h])), ones);
                }
                for (int h = 0; h < 2; h++) {
                    s[r][h] = q ? _mm256_add_epi32(s[r][h], t[h]) : t[h];
                    PD_KEEP(s[r][h]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(dx[(i0 + r) * G + g]);
            for (int h = 0; h < 2; h++) {
                const __m256 prev = g ? _mm256_loadu_ps(acc[r] + 8 * h) : _mm256_setzero_ps();
                _mm256_storeu_ps(acc[r] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), d, prev));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int l = 0; l < 16; l++) {
            const int64_t n = n0 + 16 * j + l;
            if (n < N) y[(i0 + r) * N + n] = acc[r][l] * ws[n];
        }
}

AVX2_TARGET static void q8i_avx2(const uint8_t *T, const float *ws, const int8_t *xq, const uint32_t *xw,
                                 const float *dx, int64_t K, int64_t N, int64_t n0, int S, int64_t i0, int R,
                                 float *y) {
#define CALL_Q8I_AVX2(r, wide) q8i_avx2_tile(T, S, j, ws, xq, xw, dx, K, N, n0, i0, r, wide, y)
    for (int j = 0; j < S; j++) {
        switch (R + 4 * !!xw) {
        case 1: CALL_Q8I_AVX2(1, 0); break;
        case 2: CALL_Q8I_AVX2(2, 0); break;
        case 3: CALL_Q8I_AVX2(3, 0); break;
        case 4: CALL_Q8I_AVX2(4, 0); break;
        case 5: CALL_Q8I_AVX2(1, 1); break;
        case 6: CALL_Q8I_AVX2(2, 1); break;
        case 7: CALL_Q8I_AVX2(3, 1); break;
        default: CALL_Q8I_AVX2(4, 1); break;
        }
    }
#undef CALL_Q8I_AVX2
}
#endif

/* The contract's arithmetic, one output at a time (channel n0 + c of the tile, holding w; row i). */
static void q8i_scalar(const uint8_t *T, const float *ws, const int8_t *xq, const float *dx, int64_t K, int64_t n0,
                       int S, int c, int64_t i, float *y) {
    const int64_t G = K / 32;
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        int32_t isum = 0;
        for (int64_t p = 8 * g; p < 8 * g + 8; p++)
            for (int t = 0; t < 4; t++)
                isum += (int8_t)T[((p * S + c / 16) * 16 + c % 16) * 4 + t] * xq[i * K + 4 * p + t];
        acc = fmaf((float)isum, dx[i * G + g], acc);
    }
    *y = ws[n0 + c] * acc;
}

/* ------------------------------------------------------------------------------------------------ entry points */
/* Best ISA this CPU runs for the int8-activation kernels (3, 2, 1 or 0, as above). */
int pd_best_isa(void) {
#if PD_X86
    static int best = -1;
    if (best >= 0) return best;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        best = __builtin_cpu_supports("avx512vbmi") ? 3 : 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        best = 1;
    else
        best = 0;
    return best;
#else
    return 0;
#endif
}

#if PD_X86
/* Whether this CPU's vdpbf16ps adds x_k+1 q_k+1, then x_k q_k, each addition rounded to nearest even and a
 * subnormal input read as zero: the arithmetic q4p_avx512_tile computes by FMA (the section's comment). Pairs
 * chosen so that a fused sum, the other order or a kept subnormal each give a different result. */
AVX512BF16_TARGET static int bf16_dot_is_exact(void) {
    static const float cases[][5] = {  /* acc, x_k, q_k, x_k+1, q_k+1 */
        {16777216.0f, 1, 1, 1, 1}, {1, -16777216.0f, 1, 16777216.0f, 1}, {1, 16777216.0f, 1, -16777216.0f, 1},
        {0, 1e-39f, 1, 0, 0}, {3.0f, 0.5f, -7, 1.5f, 5}, {-1e-3f, 0.0078125f, 3, -2.5f, -8}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const float *c = cases[i];
        union { float f; uint32_t u; } a = {c[1]}, b = {c[2]}, e = {c[3]}, f = {c[4]};
        __m512i x = _mm512_set1_epi32((int)((a.u >> 16) | (e.u & 0xFFFF0000u)));
        __m512i w = _mm512_set1_epi32((int)((b.u >> 16) | (f.u & 0xFFFF0000u)));
        float got = _mm512_cvtss_f32(_mm512_dpbf16_ps(_mm512_set1_ps(c[0]), (__m512bh)x, (__m512bh)w));
        float xk = fabsf(c[1]) < FLT_MIN ? 0.0f : c[1];
        float want = fmaf(xk, c[2], fmaf(c[3], c[4], c[0]));
        if (memcmp(&got, &want, sizeof got)) return 0;
    }
    return 1;
}
#endif

/* Best ISA the bfloat16-activation kernels run on this CPU: 3 with avx512_bf16 whose vdpbf16ps is the q4 sums'
 * arithmetic (bf16_dot_is_exact; q8-bf16 runs its level 2 there), 2 with avx512f/bw, 1 with AVX2 + FMA, else 0. */
int pd_bf16_best_isa(void) {
#if PD_X86
    static int best = -1;
    if (best >= 0) return best;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        best = __builtin_cpu_supports("avx512bf16") && bf16_dot_is_exact() ? 3 : 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        best = 1;
    else
        best = 0;
    return best;
#else
    return 0;
#endif
}

static int clamp_isa(int isa, int best) {
    return isa < 0 || isa > best ? best : isa;
}

/* One call's operands and scratch, shared by its threads. */
struct job {
    int q8, isa;
    const float *x;
    int64_t M, K, G, N;
    const void *w, *table;       /* q4 kinds: codes, tab (int4pack's layout); q8 kinds: w, ws */
    float *y;
    int8_t *xq; float *dx, *sx;  /* int8 kinds: x quantized per 32 (quant_row) */
    int8_t *xi; float *di, *si;  /* AVX2 int8 tiles: xq, dx and sx interleaved by blocks of 4 rows (quant_block) */
    uint32_t *xw;                /* AVX2 q8: xq widened to int16 pairs (quant_widen_one) */
    int32_t *sq;
    float *xb; int round_out;    /* bfloat16 kernels: x rounded to bfloat16, whether y is */
    int B;                       /* q4 kinds: output channels per block of int4pack's layout */
    int nthreads;                /* q4 kinds: threads the blocks are split over (run_range) */
    void (*unit)(const struct job *, int64_t, int);  /* q4 kinds: run_unit_q4i or run_unit_q4p */
    int *failed;                 /* q4 (int8 x): set when a thread cannot get its tile */
    float *xs; uint32_t *xp;     /* q4-bf16: each row's group sums X_g, its (x_k, x_k+1) bfloat16 pairs */
};


/* Run fn over 0 .. count - 1 on nthreads OpenMP threads; a single thread calls it directly (no parallel region:
 * ~1 us a call, which batch-1 decode pays 121 times a step). */
static void for_each(void (*fn)(const struct job *, int64_t), const struct job *j, int64_t count, int nthreads) {
    if (nthreads > 1 && count > 1) {
        #pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t k = 0; k < count; k++) fn(j, k);
    } else {
        for (int64_t k = 0; k < count; k++) fn(j, k);
    }
}

static void quant_one(const struct job *j, int64_t i) {
    const int64_t K = j->K, G = j->G;
#if PD_X86
    if (j->isa >= 2) {
        quant_row_avx512(j->x + i * K, K, j->xq + i * K, j->dx + i * G, j->sx + i * G, j->sq + i * G);
        return;
    }
    if (j->isa == 1) {
        quant_row_avx2(j->x + i * K, K, j->xq + i * K, j->dx + i * G, j->sx + i * G, j->sq + i * G);
        return;
    }
#endif
    quant_row(j->x + i * K, K, j->xq + i * K, j->dx + i * G, j->sx + i * G, j->sq + i * G);
}

/* Row i quantized (quant_one), then as the AVX2 q8 kernel's wide way reads it: for inputs 4 p .. 4 p + 3, the
 * int16 pairs (x0, x2) and (x1, x3) as two 32-bit words at xw[i][2 p], xw[i][2 p + 1] (vpmaddwd's operands
 * against the tile's even and odd bytes), in the same parallel region. */
static void quant_widen_one(const struct job *j, int64_t i) {
    const int64_t K = j->K;
    quant_one(j, i);
    const int8_t *x = j->xq + i * K;
    uint32_t *w = j->xw + i * (K / 2);
    for (int64_t p = 0; p < K / 4; p++) {
        w[2 * p] = (uint16_t)(int16_t)x[4 * p] | (uint32_t)(uint16_t)(int16_t)x[4 * p + 2] << 16;
        w[2 * p + 1] = (uint16_t)(int16_t)x[4 * p + 1] | (uint32_t)(uint16_t)(int16_t)x[4 * p + 3] << 16;
    }
}

#if PD_X86
/* Rows 4 b .. 4 b + 3 of x quantized (quant_one), then interleaved for the AVX2 tiles (q4i_avx2_tile), rows past M
 * zero: xi[b][p][r][4] = xq[4 b + r][4 p .. 4 p + 3] (a 4 x 4 transpose of 32-bit words per 16 bytes of the
 * rows), di[b][g][r] = dx[4 b + r][g], si likewise. One parallel region for both, each block's rows still in
 * cache when they are interleaved. */
AVX2_TARGET static void quant_block(const struct job *j, int64_t b) {
    const int64_t K = j->K, G = j->G;
    const int n = j->M - 4 * b < 4 ? (int)(j->M - 4 * b) : 4;
    const __m128i zero = _mm_setzero_si128();
    for (int r = 0; r < n; r++) quant_one(j, 4 * b + r);
    int8_t *xi = j->xi + 4 * b * K;
    for (int64_t k = 0; k < K; k += 16) {
        __m128i v[4];
        for (int r = 0; r < 4; r++)
            v[r] = r < n ? _mm_loadu_si128((const __m128i *)(j->xq + (4 * b + r) * K + k)) : zero;
        const __m128i t0 = _mm_unpacklo_epi32(v[0], v[1]), t1 = _mm_unpackhi_epi32(v[0], v[1]);
        const __m128i t2 = _mm_unpacklo_epi32(v[2], v[3]), t3 = _mm_unpackhi_epi32(v[2], v[3]);
        _mm_storeu_si128((__m128i *)(xi + 4 * k), _mm_unpacklo_epi64(t0, t2));
        _mm_storeu_si128((__m128i *)(xi + 4 * k + 16), _mm_unpackhi_epi64(t0, t2));
        _mm_storeu_si128((__m128i *)(xi + 4 * k + 32), _mm_unpacklo_epi64(t1, t3));
        _mm_storeu_si128((__m128i *)(xi + 4 * k + 48), _mm_unpackhi_epi64(t1, t3));
    }
    for (int64_t g = 0; g < G; g++)
        for (int r = 0; r < 4; r++) {
            j->di[4 * (b * G + g) + r] = r < n ? j->dx[(4 * b + r) * G + g] : 0.0f;
            j->si[4 * (b * G + g) + r] = r < n ? j->sx[(4 * b + r) * G + g] : 0.0f;
        }
}

/* round_bf16 and the flush of a subnormal result to +0, 16 lanes at a time over x[0 .. K) into xb; returns how
 * many it did (a multiple of 16: the scalar loop does the rest). */
AVX512_TARGET static int64_t round_avx512(const float *x, int64_t K, float *xb) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), flt_min = _mm512_set1_epi32(0x00800000);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512i r = _mm512_castps_si512(round_bf16_512(_mm512_loadu_ps(x + k)));
        const __mmask16 tiny = _mm512_cmplt_epu32_mask(_mm512_and_si512(r, abs_mask), flt_min);
        _mm512_storeu_si512((void *)(xb + k), _mm512_maskz_mov_epi32((__mmask16)~tiny, r));
    }
    return k;
}

/* The (x_k, x_k+1) bfloat16 pairs of the rounded row xb into xp, 16 pairs at a time; returns how many. */
AVX512_TARGET static int64_t pairs_avx512(const float *xb, int64_t K, uint32_t *xp) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    int64_t p = 0;
    for (; p + 16 <= K / 2; p += 16) {
        const __m512i lo = _mm512_loadu_si512((const void *)(xb + 2 * p));
        const __m512i hi = _mm512_loadu_si512((const void *)(xb + 2 * p + 16));
        const __m512i e = _mm512_permutex2var_epi32(lo, even, hi), o = _mm512_permutex2var_epi32(lo, odd, hi);
        _mm512_storeu_si512((void *)(xp + p), _mm512_or_si512(_mm512_srli_epi32(e, 16), _mm512_and_si512(o, high)));
    }
    return p;
}
#endif

/* Each group of 32 of xb summed in order from 0 (the q4 kernels' X_g). */
static void round_sums(const float *xb, int64_t K, float *xs) {
    const int64_t G = K / 32;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *a = xb + 32 * g;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (int t = 0; t < 32; t++) { s0 += a[t]; s1 += a[32 + t]; s2 += a[64 + t]; s3 += a[96 + t]; }
        xs[g] = s0, xs[g + 1] = s1, xs[g + 2] = s2, xs[g + 3] = s3;
    }
    for (; g < G; g++) {
        float sum = 0.0f;
        for (int64_t k = 32 * g; k < 32 * g + 32; k++) sum += xb[k];
        xs[g] = sum;
    }
}

/* Row i of x rounded to bfloat16 (a subnormal result to +0); for q4 also its group sums, and its bfloat16 pairs
 * where vdpbf16ps reads them (run_bf16). Every path gives the same bits: the rounding and the pairs are per
 * element; each group's sum is its 32 values added in order from 0, four groups' chains interleaved (a chain of
 * dependent additions was the cost). */
static void round_one(const struct job *j, int64_t i) {
    const int64_t K = j->K;
    float *xb = j->xb + i * K;
    uint32_t *xp = j->xp ? j->xp + i * (K / 2) : NULL;
    int64_t k = 0, p = 0;
#if PD_X86
    if (j->isa >= 2) k = round_avx512(j->x + i * K, K, xb);
#endif
    for (; k < K; k++) {
        float v = round_bf16(j->x[i * K + k]);
        xb[k] = fabsf(v) < FLT_MIN ? 0.0f : v;
    }
    if (j->xs) round_sums(xb, K, j->xs + i * (K / 32));
    if (!xp) return;
#if PD_X86
    if (j->isa >= 2) p = pairs_avx512(xb, K, xp);
#endif
    for (; p < K / 2; p++) {
        union { float f; uint32_t u; } lo = {xb[2 * p]}, hi = {xb[2 * p + 1]};
        xp[p] = (lo.u >> 16) | (hi.u & 0xFFFF0000u);
    }
}

/* The thread's tile of dequantized weights (q8b_avx512_dequant, q4p_avx512_dequant) of at least `floats`
 * floats, grown, never shrunk; NULL when out of memory (the callers then read the codes: the same values). */
static __thread float *wtile = NULL;
static __thread size_t wtile_size = 0;

static float *weight_tile(size_t floats) {
    size_t need = floats * sizeof(float);
    if (need > wtile_size) {
        free(wtile);
        wtile = aligned_alloc(64, (need + 63) / 64 * 64);
        wtile_size = wtile ? need : 0;
    }
    return wtile;
}

/* q8-bf16 over weight rows b * NB_Q8B .. (b + 1) * NB_Q8B - 1: MT_Q8B3 (AVX512-BF16), MT_Q8B (AVX512) or MT rows
 * of x per pass, NC_Q8B (AVX512) or NC weight rows per tile. From Q8B_DEQUANT_ROWS rows of x the AVX512 path
 * dequantizes the block once into the thread's tile and every pass reads it (each output the same sum in the same
 * order). */
static void run_block_q8b(const struct job *j, int64_t b) {
    const int64_t M = j->M, K = j->K, N = j->N;
    const int64_t n1 = (b + 1) * NB_Q8B < N ? (b + 1) * NB_Q8B : N;
    const int64_t mt = j->isa == 3 ? MT_Q8B3 : j->isa >= 2 ? MT_Q8B : MT;
#if PD_X86
    float *W = NULL;  /* level 2: float32 [n1 - n][K]; level 3: bfloat16, the same tile reused */
    if (j->isa >= 2 && M >= Q8B_DEQUANT_ROWS && (W = weight_tile((size_t)(NB_Q8B * K)))) {
        if (j->isa == 3) q8b_bf16_dequant(j->w, b * NB_Q8B, n1, K, (uint16_t *)W);
        else q8b_avx512_dequant(j->w, j->table, b * NB_Q8B, n1, K, W);
    }
#endif
    for (int64_t i0 = 0; i0 < M; i0 += mt) {
        int R = M - i0 < mt ? (int)(M - i0) : (int)mt;
        int C;
        for (int64_t n = b * NB_Q8B; n < n1; n += C) {
            const int64_t nc = j->isa >= 2 ? NC_Q8B : NC;
            C = n1 - n < nc ? (int)(n1 - n) : (int)nc;
#if PD_X86
            if (j->isa == 3) {
                q8b_bf16dot(j->w, j->table, W ? (const uint16_t *)W + (n - b * NB_Q8B) * K : NULL,
                            (const uint16_t *)j->xp, n, C, i0, R, K, N, j->round_out, j->y);
                continue;
            }
            if (j->isa == 2) {
                q8b_avx512(j->w, j->table, W ? W + (n - b * NB_Q8B) * K : NULL, j->xb, n, C, i0, R, K, N, j->round_out,
                           j->y);
                continue;
            }
            if (j->isa == 1) { q8b_avx2(j->w, j->table, j->xb, n, C, i0, R, K, N, j->round_out, j->y); continue; }
#endif
            for (int c = 0; c < C; c++)
                for (int r = 0; r < R; r++) {
                    float *out = j->y + (i0 + r) * N + n + c;
                    q8b_scalar(j->w, j->table, j->xb, n + c, i0 + r, K, out);
                    if (j->round_out) *out = round_bf16(*out);
                }
        }
    }
}

/* q4-bf16 over unit u (0: all of block b, 1: its low half, 2: its high half) against every row of x, MT_Q4P
 * (AVX512) or MT rows per pass. From Q4P_DEQUANT_ROWS rows AVX512 dequantizes the unit's q' once into the
 * thread's tile (bfloat16 pairs at level 3). A row's sums are the same in any pass and on every path. */
static void run_unit_q4p(const struct job *j, int64_t b, int u) {
    const int64_t M = j->M, K = j->K, N = j->N, n0 = b * j->B;
    const int64_t c0 = u == 2 ? n0 + j->B / 2 : n0, c1 = u == 1 ? n0 + j->B / 2 : n0 + j->B;  /* its channels */
    const uint8_t *codes = j->w;
    const uint32_t *tab = j->table;
    const int64_t mt = j->isa >= 2 ? MT_Q4P : MT;
#if PD_X86
    float *W = NULL;
    if (j->isa == 1 && M >= Q4P_AVX2_DEQUANT_ROWS && (W = weight_tile((size_t)(Q4P_AVX2_CHUNK * (c1 - c0))))) {
        for (int64_t k0 = 0; k0 < K; k0 += Q4P_AVX2_CHUNK) {  /* a chunk dequantized, then every row over it */
            const int64_t k1 = K - k0 < Q4P_AVX2_CHUNK ? K : k0 + Q4P_AVX2_CHUNK;
            q4p_avx2_dequant(codes, K, j->B, n0, c0, c1, k0, k1, W);
            for (int64_t i0 = 0; i0 < M; i0 += MT_Q4P_AVX2)
                for (int64_t n = c0; n < c1; n += 16)
                    q4p_avx2_chunks(W + (n - c0), c1 - c0, tab, j->xb, j->xs, K, N, n, k0, k1, i0,
                                    M - i0 < MT_Q4P_AVX2 ? (int)(M - i0) : MT_Q4P_AVX2, j->round_out, j->y);
        }
        return;
    }
    float *tile = NULL;  /* NULL below Q4P_DEQUANT_ROWS or when out of memory: the codes are read */
    if (j->isa >= 2 && M >= Q4P_DEQUANT_ROWS && (tile = weight_tile((size_t)(K * j->B))))
        q4p_avx512_dequant(codes, K, j->B, n0, u, j->isa == 3 ? NULL : tile,
                           j->isa == 3 ? (uint32_t *)tile : NULL);
#endif
    for (int64_t i0 = 0; i0 < M; i0 += mt) {
        int R = M - i0 < mt ? (int)(M - i0) : (int)mt;
#if PD_X86
        if (j->isa == 3 && tile) {
            q4p_bf16dot(tab, (const uint32_t *)tile, j->xp, j->xs, K, N, j->B, n0, u, i0, R, j->round_out, j->y);
            continue;
        }
        if (j->isa >= 2) {
            q4p_avx512(codes, tab, j->isa == 3 ? NULL : tile, j->xb, j->xs, K, N, j->B, n0, u, i0, R, j->round_out,
                       j->y);
            continue;
        }
        if (j->isa == 1 && R <= Q4P_PAIR_ROWS && u == 0) {  /* a whole block: both nibbles' channels together */
            for (int64_t o = 0; o < j->B / 2; o += 16)
                q4p_avx2_pair(codes, tab, j->xb, j->xs, K, N, j->B, n0, o, i0, R, j->round_out, j->y);
            continue;
        }
        if (j->isa == 1) {
            for (int64_t n = c0; n < c1; n += 16)
                q4p_avx2(codes, tab, j->xb, j->xs, K, N, j->B, n, i0, R, j->round_out, j->y);
            continue;
        }
#endif
        for (int r = 0; r < R; r++)
            for (int64_t n = c0; n < c1; n++) {
                float *out = j->y + (i0 + r) * N + n;
                q4p_scalar(codes, tab, j->xb, j->xs, K, N, j->B, n, i0 + r, out);
                if (j->round_out) *out = round_bf16(*out);
            }
    }
}

/* q4 (int8 x) over unit u of block b (as run_unit_q4p's) against every row of x: the unit's codes spread into
 * the thread's tile (q4i_tile_*) once, then MT_Q4I (AVX512) or MT_Q4I_AVX2_TILE rows of x a pass over it. */
static void run_unit_q4i(const struct job *j, int64_t b, int u) {
    const int64_t M = j->M, K = j->K, N = j->N, n0 = b * j->B;
    const int s0 = u == 2 ? j->B / 32 : 0, S = u == 0 ? j->B / 16 : j->B / 32;  /* its slices of 16 channels */
    const int64_t c0 = n0 + 16 * s0;
    const uint8_t *cb = (const uint8_t *)j->w + n0 / j->B * K * (j->B / 2);
    const int direct = j->isa == 1 ? M < Q4I_AVX2_TILE_ROWS : j->isa >= 2 && j->B == 64 && M < Q4I_TILE_ROWS;
    uint8_t *T = NULL;
    if (!direct) {
        if (!(T = (uint8_t *)weight_tile((size_t)(4 * K * S)))) { *j->failed = 1; return; }  /* K / 4 x S x 64 bytes */
#if PD_X86
        if (j->isa == 3 && j->B == 64) q4i_tile_vbmi(j->w, K, n0, s0, S, T);
        else if (j->isa == 2 && j->B == 64) q4i_tile_avx512(j->w, K, n0, s0, S, T);
        else if (j->isa >= 1) q4i_tile_avx2(j->w, K, j->B, n0, s0, S, T);
        else
#endif
            q4i_tile_scalar(j->w, K, j->B, n0, s0, S, T);
    }
    const int64_t mt = j->isa >= 2 ? MT_Q4I : j->isa == 1 ? (T ? MT_Q4I_AVX2_TILE : MT_Q4I_AVX2) : 1;
    for (int64_t i0 = 0; i0 < M; i0 += mt) {
        const int R = M - i0 < mt ? (int)(M - i0) : (int)mt;
#if PD_X86
        if (j->isa >= 2) {
            (j->isa == 3 ? q4i_vnni_vbmi : q4i_vnni)(T, cb, s0, j->table, j->xq, j->dx, j->sx, K, N, c0, S, i0, R,
                                                      j->y);
            continue;
        }
        if (j->isa == 1) {
            if (T)  /* the next pass's output lines, for writing: in a large matmul they are in no cache, and the
                     * tile's first store to each (a group's totals) held up the stores behind it (BENCHMARKS.md) */
                for (int64_t i = i0 + mt; i < M && i < i0 + 2 * mt; i++)
                    for (int s = 0; s < S; s++)
                        _mm_prefetch((const char *)(j->y + i * N + c0 + 16 * s), _MM_HINT_ET0);
            q4i_avx2(T, cb, j->B, n0, s0, j->table, j->xq, j->dx, j->sx, j->xi, j->di, j->si, K, N, S, i0, R, j->y);
            continue;
        }
#endif
        for (int c = 0; c < 16 * S; c++)
            q4i_scalar(T, j->table, j->xq, j->dx, j->sx, K, N, c0, S, c, i0, j->y + i0 * N + c0 + c);
    }
}

/* q8 (int8 x) over output channels b * NB_Q8I .. (b + 1) * NB_Q8I - 1 against every row of x: the unit spread
 * into the thread's tile once, then MT_Q4I (AVX512) or MT_Q8I_AVX2 rows of x a pass over it. */
static void run_block_q8i(const struct job *j, int64_t b) {
    const int64_t M = j->M, K = j->K, N = j->N, n0 = b * NB_Q8I;
    const int S = (int)((N - n0 >= NB_Q8I ? NB_Q8I : N - n0) + 15) / 16;
    uint8_t *T = (uint8_t *)weight_tile((size_t)(4 * K * S));  /* K / 4 x S x 64 bytes */
    if (!T) { *j->failed = 1; return; }
#if PD_X86
    if (j->isa >= 2) q8i_tile_avx512(j->w, K, N, n0, S, T);
    else if (j->isa == 1) q8i_tile_avx2(j->w, K, N, n0, S, T);
    else
#endif
        q8i_tile_scalar(j->w, K, N, n0, S, 0, T);
    const int64_t mt = j->isa >= 2 ? MT_Q4I : j->isa == 1 ? MT_Q8I_AVX2 : 1;
    for (int64_t i0 = 0; i0 < M; i0 += mt) {
        const int R = M - i0 < mt ? (int)(M - i0) : (int)mt;
#if PD_X86
        if (j->isa >= 2) { q8i_vnni(T, j->table, j->xq, j->dx, j->sq, K, N, n0, S, i0, R, j->y); continue; }
        if (j->isa == 1) { q8i_avx2(T, j->table, j->xq, j->xw, j->dx, K, N, n0, S, i0, R, j->y); continue; }
#endif
        for (int c = 0; c < 16 * S && n0 + c < N; c++)
            q8i_scalar(T, j->table, j->xq, j->dx, K, n0, S, c, i0, j->y + i0 * N + n0 + c);
    }
}

/* Thread t of j->nthreads: half-blocks t * H / T .. (t + 1) * H / T - 1 of the H = 2 N / B, so that every
 * thread gets the same number of channels (9 blocks on 2 threads: 4.5 each, not 5 and 4); a block wholly in
 * the range is run as one unit (its codes read once), a half at either end on its own. Each output channel is
 * computed the same way whichever unit holds it: the result does not depend on the thread count. */
static void run_range(const struct job *j, int64_t t) {
    const int64_t H = 2 * (j->N / j->B);
    int64_t h = t * H / j->nthreads, h1 = (t + 1) * H / j->nthreads;
    if (h < h1 && h % 2) { j->unit(j, h / 2, 2); h++; }
    for (; h + 2 <= h1; h += 2) j->unit(j, h / 2, 0);
    if (h < h1) j->unit(j, h / 2, 1);
}

/* Quantize x into the thread's scratch, then run every block (q8) or unit (q4). Returns the ISA used, or -1
 * when out of memory. */
static int run(int q8, const float *x, int64_t M, int64_t K, const void *w, const void *table, int64_t N, int B,
               float *y, int nthreads, int isa) {
    int failed = 0;
    struct job j = {.q8 = q8, .isa = clamp_isa(isa, pd_best_isa()), .x = x, .M = M, .K = K, .G = K / 32, .N = N,
                    .w = w, .table = table, .y = y, .B = B, .nthreads = nthreads > 1 ? nthreads : 1,
                    .unit = run_unit_q4i, .failed = &failed};
    const size_t xq_bytes = (size_t)(M * K + 64 + 63) / 64 * 64;
    const size_t g_bytes = (size_t)(M * j.G + 16) * sizeof(float);
    /* the AVX2 q4 tile reads x interleaved (q4i_avx2_tile) */
    const int64_t blocks = j.isa == 1 && !q8 && M >= Q4I_AVX2_TILE_ROWS ? (M + 3) / 4 : 0;
    const size_t xi_bytes = (size_t)(4 * blocks * K + 63) / 64 * 64, gi_bytes = (size_t)(4 * blocks * j.G) * 4;
    const size_t xw_bytes = j.isa == 1 && q8 && M >= Q8I_AVX2_WIDE_ROWS ? (size_t)(2 * M * K) : 0;
    char *base = get_scratch(xq_bytes + 3 * g_bytes + xi_bytes + 2 * gi_bytes + xw_bytes);
    if (!base) return -1;
    j.xq = (int8_t *)base;
    j.dx = (float *)(base + xq_bytes);
    j.sx = (float *)(base + xq_bytes + g_bytes);
    j.sq = (int32_t *)(base + xq_bytes + 2 * g_bytes);
    if (blocks) {
        j.xi = (int8_t *)(base + xq_bytes + 3 * g_bytes);
        j.di = (float *)(base + xq_bytes + 3 * g_bytes + xi_bytes);
        j.si = (float *)(base + xq_bytes + 3 * g_bytes + xi_bytes + gi_bytes);
#if PD_X86
        for_each(quant_block, &j, blocks, nthreads);
#endif
    } else if (xw_bytes) {
        j.xw = (uint32_t *)(base + xq_bytes + 3 * g_bytes + xi_bytes + 2 * gi_bytes);
        for_each(quant_widen_one, &j, M, M >= 8 ? nthreads : 1);
    } else {
        for_each(quant_one, &j, M, M >= 8 ? nthreads : 1);
    }
    if (q8) for_each(run_block_q8i, &j, (N + NB_Q8I - 1) / NB_Q8I, nthreads);
    else for_each(run_range, &j, j.nthreads, j.nthreads);
    return failed ? -1 : j.isa;
}

static int run_bf16(int q8, const float *x, int64_t M, int64_t K, const void *w, const void *table, int64_t N, int B,
                    float *y, int nthreads, int isa, int round_out) {
    struct job j = {.q8 = q8, .isa = clamp_isa(isa, pd_bf16_best_isa()), .x = x, .M = M, .K = K, .G = K / 32, .N = N,
                    .w = w, .table = table, .y = y, .round_out = round_out, .B = B,
                    .nthreads = nthreads > 1 ? nthreads : 1, .unit = run_unit_q4p};
    /* xb [M][K] (+ 16: the AVX512 q8 tile may read past a row's end), then for q4 xs [M][K / 32], and where
     * vdpbf16ps reads x (level 3: q8, and q4's tile) xp [M][K / 2] */
    const int64_t xs_floats = q8 ? 0 : M * (K / 32);
    const int64_t xp_words = j.isa == 3 && (q8 || M >= Q4P_DEQUANT_ROWS) ? M * (K / 2) : 0;
    j.xb = get_scratch((size_t)(M * K + 16 + xs_floats + xp_words) * sizeof(float));
    if (!j.xb) return -1;
    if (xs_floats) j.xs = j.xb + M * K + 16;
    if (xp_words) j.xp = (uint32_t *)(j.xb + M * K + 16 + xs_floats);
    for_each(round_one, &j, M, M >= 8 ? nthreads : 1);
    if (q8) for_each(run_block_q8b, &j, (N + NB_Q8B - 1) / NB_Q8B, nthreads);
    else for_each(run_range, &j, j.nthreads, j.nthreads);
    return j.isa;
}

/* y [M, N] float32 = bf16(x) @ W.T for W[n, k] = (q - 8) * d + z in int4pack_mm's layout (codes [N / B][K][B / 2],
 * tab [K / 32][N]; section "bfloat16 x"), B 64 or 32, N % B == 0, K % 32 == 0; rounded to bfloat16 values when
 * round_out. Returns the ISA used, or -1 when out of memory. */
static int q4_bf16_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint32_t *tab,
                          int64_t N, int B, float *y, int nthreads, int isa, int round_out) {
    return run_bf16(0, x, M, K, codes, tab, N, B, y, nthreads, isa, round_out);
}

/* y [M, N] float32 = bf16(x) @ (w * ws[:, None]).T (w, ws as for q8_matmul), rounded to bfloat16 values
 * when round_out; K % 32 == 0. Returns the ISA used, or -1 when out of memory. */
static int q8_bf16_matmul(const float *x, int64_t M, int64_t K, const int8_t *w, const float *ws, int64_t N,
                          float *y, int nthreads, int isa, int round_out) {
    return run_bf16(1, x, M, K, w, ws, N, 0, y, nthreads, isa, round_out);
}

/* y [M, N] float32 = x [M, K] float32 @ W.T for W[n, k] = q * d + m in int4pack_mm's layout (as for
 * q4_bf16_matmul), x quantized per 32 inputs (section "q4, int8 x"). Returns the ISA used, or -1 when out of
 * memory. */
static int q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint32_t *tab, int64_t N,
                     int B, float *y, int nthreads, int isa) {
    return run(0, x, M, K, codes, tab, N, B, y, nthreads, isa);
}

/* y [M, N] float32 = x [M, K] float32 @ (w * ws[:, None]).T, w int8 [N, K] in [-127, 127], K % 32 == 0.
 * Returns the ISA used, or -1 when out of memory. */
static int q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *w, const float *ws, int64_t N, float *y,
                     int nthreads, int isa) {
    return run(1, x, M, K, w, ws, N, 0, y, nthreads, isa);
}

/* One weight's operands, filled once by the caller (kernels/cpu_matmul.py mirrors this as a ctypes Structure):
 * kind 0 q4, 1 q8, 2 q4-bf16, 3 q8-bf16; w, table, K, N (B and round_out for the bfloat16 kinds) as for that
 * kind's function above; isa as for all of them (out of range: the best this CPU has). */
struct pd_weight {
    const void *w, *table;
    int64_t K, N;
    int32_t kind, isa, B, round_out;
};

/* y [M, N] float32 = x [M, K] @ the weight of `wt`, on nthreads threads. Five arguments, not eleven: ctypes
 * converts each argument on every call, ~0.15 us apiece, and batch-1 decode makes 121 calls a step. Returns
 * the ISA used, -1 when out of memory, -2 for an unknown kind. */
int pd_matmul(const struct pd_weight *wt, const float *x, int64_t M, float *y, int nthreads) {
    switch (wt->kind) {
        case 0: return q4_matmul(x, M, wt->K, wt->w, wt->table, wt->N, wt->B, y, nthreads, wt->isa);
        case 1: return q8_matmul(x, M, wt->K, wt->w, wt->table, wt->N, y, nthreads, wt->isa);
        case 2: return q4_bf16_matmul(x, M, wt->K, wt->w, wt->table, wt->N, wt->B, y, nthreads, wt->isa,
                                      wt->round_out);
        case 3: return q8_bf16_matmul(x, M, wt->K, wt->w, wt->table, wt->N, y, nthreads, wt->isa, wt->round_out);
        default: return -2;
    }
}

/* n matmuls in one call, in order: ys[i] [M, N_i] = xs[i] [M, K_i] @ wts[i] (pd_matmul each). What a sequence of
 * linears costs without a caller between them (the native decoder's view of the kernels; bench/bench_kernels.py
 * times it beside the same matmuls called one by one from Python). Returns pd_matmul's first negative result, else
 * the last ISA used. */
int pd_matmul_chain(const struct pd_weight *const *wts, const float *const *xs, float *const *ys, int64_t n,
                    int64_t M, int nthreads) {
    int r = 0;
    for (int64_t i = 0; i < n; i++)
        if ((r = pd_matmul(wts[i], xs[i], M, ys[i], nthreads)) < 0)
            return r;
    return r;
}
