/* Which AVX2 instructions compete with vpmaddubsw for the same execution ports: the int8-activation kernels of
 * kernels/cpu_matmul.c spend their time in vpmaddubsw, and every other instruction of their loops either runs
 * beside it for free or takes its place. Six independent vpmaddubsw chains alone, then each paired with one
 * independent chain of another instruction; a pairing that runs at the rate alone is free, one at half of it
 * shares both ports. A benchmark helper only: gcc -O2 -o avx2_ports bench/avx2_ports.c && ./avx2_ports */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 400000000L
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECL(i) __m256i a##i = _mm256_set1_epi16(i + v), c##i = _mm256_set1_epi16(3 * i + v);
#define BASE(i) a##i = _mm256_maddubs_epi16(a##i, b);
#define F(x) _mm256_castsi256_ps(x)
#define I(x) _mm256_castps_si256(x)
#define SUM(i) s += _mm256_extract_epi32(a##i, 0) + _mm256_extract_epi32(c##i, 0);
#define TIME(label, body)                                                                   \
    {                                                                                      \
        double t = now();                                                                  \
        for (long n = 0; n < N / 6; n++) { CHAINS(body) }                                  \
        printf("%-34s %.2f G vpmaddubsw/s\n", label, N / (now() - t) / 1e9);                    \
    }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define P_ALONE(i) BASE(i)
#define P_ADDW(i) BASE(i) c##i = _mm256_add_epi16(c##i, b);
#define P_AND(i) BASE(i) c##i = _mm256_and_si256(c##i, b);
#define P_SRAI(i) BASE(i) c##i = _mm256_srai_epi32(c##i, 1);
#define P_CVT(i) BASE(i) c##i = I(_mm256_cvtepi32_ps(c##i));
#define P_ADDPS(i) BASE(i) c##i = I(_mm256_add_ps(F(c##i), F(b)));
#define P_MULPS(i) BASE(i) c##i = I(_mm256_mul_ps(F(c##i), F(b)));
#define P_FMA(i) BASE(i) c##i = I(_mm256_fmadd_ps(F(c##i), F(b), F(b)));
#define P_MADD(i) BASE(i) c##i = _mm256_madd_epi16(c##i, b);
#define P_SIGN(i) BASE(i) c##i = _mm256_sign_epi8(c##i, b);
#define P_ABS(i) BASE(i) c##i = _mm256_abs_epi8(c##i);
#define P_PSHUFB(i) BASE(i) c##i = _mm256_shuffle_epi8(c##i, b);
#define P_MOVSX(i) BASE(i) c##i = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(c##i));

__attribute__((target("avx2,fma"))) int main(int argc, char **argv) {
    (void)argv;
    const int v = argc;
    const __m256i b = _mm256_set1_epi8(3);
    CHAINS(DECL)
    TIME("vpmaddubsw alone", P_ALONE)
    TIME("+ vpaddw", P_ADDW)
    TIME("+ vpand", P_AND)
    TIME("+ vpsrad", P_SRAI)
    TIME("+ vcvtdq2ps", P_CVT)
    TIME("+ vaddps", P_ADDPS)
    TIME("+ vmulps", P_MULPS)
    TIME("+ vfmadd", P_FMA)
    TIME("+ vpmaddwd", P_MADD)
    TIME("+ vpsignb", P_SIGN)
    TIME("+ vpabsb", P_ABS)
    TIME("+ vpshufb", P_PSHUFB)
    TIME("+ vpmovsxwd", P_MOVSX)
    int s = 0;
    CHAINS(SUM)
    return s == 42;  /* keeps the chains live */
}
