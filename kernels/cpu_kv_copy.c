/* Copy-and-hash of paged KV pieces (kernels/cpu_kv_copy.py builds and loads this file; its docstring is the
 * contract, its Python loops the definition). Plain C11, no torch headers, no xxhash headers.
 *
 * Two xxh3-128s: the installed xxhash package's own build, whose functions Python resolves and hands over once
 * (pd_kv_copy_init), for any layout; and, for blocks whose pieces are whole 64-byte stripes (every KV layout with
 * blocks of 16 tokens; for a stream, records of whole stripes), xxh3-128's long-input loop written out here
 * (XXH3_hashLong_128b over the default secret, seed 0: the same digests, tested against the package over many
 * layouts) so that the copy and the hash are one pass: each stripe is loaded once, stored to its destination and
 * folded into the accumulators from the register it was stored from. What is hashed is then exactly what was
 * written: the destination is the caller's own memory, which nothing else writes. The stores stream past the
 * caches (a landed block is read again only by a later decode step), so the destination's lines are not read
 * first either: one read and one write per byte.
 *
 * Block i is num_pieces pieces of piece_bytes bytes at base + bases[i] + p * stride, p = 0 .. num_pieces - 1. The
 * caller has checked that every piece lies inside its buffer: nothing here checks a bound.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PD_X86 1
#else
#define PD_X86 0
#endif

/* xxhash.h's XXH128_hash_t and XXH128_canonical_t, by value the same structs (the ABI is the platform's). */
typedef struct { uint64_t low64, high64; } pd_xxh128;
typedef struct { unsigned char digest[16]; } pd_xxh128_canonical;

static void *(*xxh3_create_state)(void);
static int (*xxh3_free_state)(void *);
static int (*xxh3_128_reset)(void *);
static int (*xxh3_128_update)(void *, const void *, size_t);
static pd_xxh128 (*xxh3_128_digest)(const void *);
static void (*xxh128_canonical_from_hash)(pd_xxh128_canonical *, pd_xxh128);

void pd_kv_copy_init(void *(*create_state)(void), int (*free_state)(void *), int (*reset)(void *),
                     int (*update)(void *, const void *, size_t), pd_xxh128 (*digest)(const void *),
                     void (*canonical_from_hash)(pd_xxh128_canonical *, pd_xxh128))
{
    xxh3_create_state = create_state;
    xxh3_free_state = free_state;
    xxh3_128_reset = reset;
    xxh3_128_update = update;
    xxh3_128_digest = digest;
    xxh128_canonical_from_hash = canonical_from_hash;
}

/* Each piece may start a new hardware prefetch stream (the next piece of a walk is another block's, or another
 * plane's, and the L2 streamer does not cross 4 KiB pages), and nothing is fetched while a landed piece is hashed
 * from L1. So while piece k of a walk is hashed, the head of every 4 KiB page of piece k + 2 is asked for.
 * Measured on a Xeon, 12 KiB pieces, block by block, 20 paired runs: copy+hash 6-8% faster (64 and 256 blocks),
 * hash alone 12% faster at 64 blocks, no change at 256 (DRAM bound); a whole piece ahead, or prefetching before
 * the copy, is slower (they queue behind its misses). On a Zen 4, plane by plane (fused_copy_hash): 10% faster
 * than no prefetch at 64 blocks, 3% at 256; 1 or 4 pieces ahead within 2%, 1 KiB a page slower. */
#define PREFETCH_AHEAD 2
#define PREFETCH_PAGE_BYTES 512
#if defined(__GNUC__)
#define PREFETCH(address) __builtin_prefetch((address), 0, 3)
#else
#define PREFETCH(address) ((void)(address))
#endif

static void prefetch_piece(const uint8_t *piece, int64_t piece_bytes)
{
    for (int64_t page = 0; page < piece_bytes; page += 4096)
        for (int64_t off = page; off < page + PREFETCH_PAGE_BYTES && off < piece_bytes; off += 64)
            PREFETCH(piece + off);
}

/* ------------------------------------------------------------------------------ xxh3-128, long inputs, fused */
/* xxhash.h's XXH3_kSecret, XXH_PRIME*, XXH3_INIT_ACC, XXH_SECRET_LASTACC_START / MERGEACCS_START (v0.8). */
static const uint8_t XXH3_SECRET[192] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define XXH_P32_1 0x9E3779B1U
#define XXH_P32_2 0x85EBCA77U
#define XXH_P32_3 0xC2B2AE3DU
#define XXH_P64_1 0x9E3779B185EBCA87ULL
#define XXH_P64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_P64_3 0x165667B19E3779F9ULL
#define XXH_P64_4 0x85EBCA77C2B2AE63ULL
#define XXH_P64_5 0x27D4EB2F165667C5ULL
#define STRIPE 64
#define STRIPES_PER_BLOCK 16          /* (sizeof XXH3_SECRET - STRIPE) / 8: a scramble after each 1 KiB */
#define SCRAMBLE_KEY (192 - STRIPE)
#define LASTACC_KEY (192 - STRIPE - 7)
#define MERGE_LOW_KEY 11
#define MERGE_HIGH_KEY (192 - STRIPE - 11)
#define STREAM_PREFETCH_BYTES 512     /* xxhash's XXH_PREFETCH_DIST (AVX512 builds): the 8th stripe ahead */

/* The xxh3 accumulators of one record being hashed: stripe `next` of `last + 1` comes next. The last stripe of a
 * record (its last 64 bytes: the record is whole stripes) is folded with its own key and not followed by a
 * scramble, as XXH3_hashLong_internal_loop does. */
typedef struct {
    uint64_t acc[8] __attribute__((aligned(64)));
    int64_t next, last;
} pd_xxh3_long;

static void xxh3_long_start(pd_xxh3_long *h, int64_t record_bytes)
{
    static const uint64_t init[8] = {XXH_P32_3, XXH_P64_1, XXH_P64_2, XXH_P64_3, XXH_P64_4, XXH_P32_2, XXH_P64_5,
                                     XXH_P32_1};
    memcpy(h->acc, init, sizeof init);
    h->next = 0;
    h->last = record_bytes / STRIPE - 1;
}

static inline uint64_t read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);  /* little endian: x86 and every platform torch's CPU build runs on */
    return v;
}

/* The run of stripes from h->next that share one key sequence: up to the end of the 1 KiB block (a scramble follows
 * when it ends there), n at most, and never the record's last stripe, which goes alone with its own key. Returns
 * the run's length (0: the next stripe is the last) and its first key. */
static inline int64_t stripe_run(const pd_xxh3_long *h, int64_t n, const uint8_t **key)
{
    const int64_t in_block = h->next % STRIPES_PER_BLOCK;
    int64_t m = STRIPES_PER_BLOCK - in_block;
    m = m < n ? m : n;
    m = m < h->last - h->next ? m : h->last - h->next;
    *key = XXH3_SECRET + (m ? in_block * 8 : LASTACC_KEY);
    return m;
}

/* Whether the run that ended at h->next completed a block (a scramble follows; never after the last stripe). */
static inline int block_done(const pd_xxh3_long *h)
{
    return h->next % STRIPES_PER_BLOCK == 0 && h->next <= h->last;
}

static void fold_stripe_scalar(uint64_t *acc, const uint8_t *in, const uint8_t *key)
{
    for (int lane = 0; lane < 8; lane++) {
        uint64_t data = read64(in + 8 * lane), data_key = data ^ read64(key + 8 * lane);
        acc[lane ^ 1] += data;
        acc[lane] += (data_key & 0xFFFFFFFFULL) * (data_key >> 32);
    }
}

/* n stripes of src folded into h, and copied to dst unless it is NULL: portable, AVX2, AVX512 (their stores to
 * dst stream past the caches when dst is aligned to the vector, unless keep_cached). */
static void xxh3_stripes_scalar(pd_xxh3_long *h, const uint8_t *src, uint8_t *dst, int64_t n, int keep_cached)
{
    (void)keep_cached;
    uint64_t *acc = h->acc;
    while (n > 0) {
        const uint8_t *key;
        int64_t m = stripe_run(h, n, &key), run = m ? m : 1;
        if (dst) {
            memcpy(dst, src, (size_t)(run * STRIPE));
            dst += run * STRIPE;
        }
        for (int64_t s = 0; s < run; s++)
            fold_stripe_scalar(acc, src + s * STRIPE, key + 8 * s);
        src += run * STRIPE, n -= run, h->next += run;
        if (m && block_done(h))
            for (int lane = 0; lane < 8; lane++) {
                uint64_t a = acc[lane];
                a ^= a >> 47;
                a ^= read64(XXH3_SECRET + SCRAMBLE_KEY + 8 * lane);
                acc[lane] = a * XXH_P32_1;
            }
    }
}

#if PD_X86
#define KV_AVX2_TARGET __attribute__((target("avx2")))
#define KV_AVX512_TARGET __attribute__((target("avx512f,avx2")))
#define KV_INLINE static inline __attribute__((always_inline))
enum { HASH_ONLY, STREAM_STORES, PLAIN_STORES };  /* what the vector loops do with dst: one loop each */

KV_AVX2_TARGET KV_INLINE void stripes_avx2(pd_xxh3_long *h, const uint8_t *src, uint8_t *dst, int64_t n,
                                           const int stores)
{
    __m256i acc0 = _mm256_load_si256((const __m256i *)h->acc), acc1 = _mm256_load_si256((const __m256i *)h->acc + 1);
    const __m256i prime = _mm256_set1_epi32((int)XXH_P32_1);
    while (n > 0) {
        const uint8_t *key;
        int64_t m = stripe_run(h, n, &key), run = m ? m : 1;
        for (int64_t s = 0; s < run; s++, src += STRIPE, key += 8) {
            PREFETCH(src + STREAM_PREFETCH_BYTES);
            __m256i d0 = _mm256_loadu_si256((const __m256i *)src), d1 = _mm256_loadu_si256((const __m256i *)src + 1);
            if (stores == STREAM_STORES) {
                _mm256_stream_si256((__m256i *)dst, d0);
                _mm256_stream_si256((__m256i *)dst + 1, d1);
            } else if (stores == PLAIN_STORES) {
                _mm256_storeu_si256((__m256i *)dst, d0);
                _mm256_storeu_si256((__m256i *)dst + 1, d1);
            }
            if (stores != HASH_ONLY)
                dst += STRIPE;
            __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)key));
            __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)key + 1));
            acc0 = _mm256_add_epi64(_mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32)),
                                    _mm256_add_epi64(acc0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
            acc1 = _mm256_add_epi64(_mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32)),
                                    _mm256_add_epi64(acc1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
        }
        n -= run, h->next += run;
        if (m && block_done(h)) {
            __m256i *accs[2] = {&acc0, &acc1};
            for (int half = 0; half < 2; half++) {
                __m256i a = _mm256_xor_si256(*accs[half], _mm256_srli_epi64(*accs[half], 47));
                a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(XXH3_SECRET + SCRAMBLE_KEY) + half));
                __m256i lo = _mm256_mul_epu32(a, prime), hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
                *accs[half] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
            }
        }
    }
    _mm256_store_si256((__m256i *)h->acc, acc0);
    _mm256_store_si256((__m256i *)h->acc + 1, acc1);
}

KV_AVX2_TARGET static void xxh3_stripes_avx2(pd_xxh3_long *h, const uint8_t *src, uint8_t *dst, int64_t n,
                                             int keep_cached)
{
    if (!dst)
        stripes_avx2(h, src, dst, n, HASH_ONLY);
    else if (!keep_cached && (uintptr_t)dst % 32 == 0)
        stripes_avx2(h, src, dst, n, STREAM_STORES);
    else
        stripes_avx2(h, src, dst, n, PLAIN_STORES);
}

KV_AVX512_TARGET KV_INLINE void stripes_avx512(pd_xxh3_long *h, const uint8_t *src, uint8_t *dst, int64_t n,
                                               const int stores)
{
    __m512i acc = _mm512_load_si512(h->acc);
    const __m512i prime = _mm512_set1_epi32((int)XXH_P32_1);
    while (n > 0) {
        const uint8_t *key;
        int64_t m = stripe_run(h, n, &key), run = m ? m : 1;
        for (int64_t s = 0; s < run; s++, src += STRIPE, key += 8) {
            PREFETCH(src + STREAM_PREFETCH_BYTES);
            __m512i data = _mm512_loadu_si512(src);
            if (stores == STREAM_STORES)
                _mm512_stream_si512((__m512i *)dst, data);
            else if (stores == PLAIN_STORES)
                _mm512_storeu_si512(dst, data);
            if (stores != HASH_ONLY)
                dst += STRIPE;
            __m512i data_key = _mm512_xor_si512(data, _mm512_loadu_si512(key));
            __m512i swapped = _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
            acc = _mm512_add_epi64(_mm512_mul_epu32(data_key, _mm512_srli_epi64(data_key, 32)),
                                   _mm512_add_epi64(acc, swapped));
        }
        n -= run, h->next += run;
        if (m && block_done(h)) {
            __m512i a = _mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47));
            a = _mm512_xor_si512(a, _mm512_loadu_si512(XXH3_SECRET + SCRAMBLE_KEY));
            __m512i lo = _mm512_mul_epu32(a, prime), hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
            acc = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
        }
    }
    _mm512_store_si512(h->acc, acc);
}

KV_AVX512_TARGET static void xxh3_stripes_avx512(pd_xxh3_long *h, const uint8_t *src, uint8_t *dst, int64_t n,
                                                 int keep_cached)
{
    if (!dst)
        stripes_avx512(h, src, dst, n, HASH_ONLY);
    else if (!keep_cached && (uintptr_t)dst % 64 == 0)
        stripes_avx512(h, src, dst, n, STREAM_STORES);
    else
        stripes_avx512(h, src, dst, n, PLAIN_STORES);
}
#endif

/* keep_cached: plain stores even to an aligned dst (what is written is read again soon: a grpc message). */
typedef void (*xxh3_stripes_fn)(pd_xxh3_long *, const uint8_t *, uint8_t *, int64_t, int keep_cached);

/* isa: 0 portable, 1 AVX2, 2 AVX512, -1 the best this CPU runs (one it lacks falls back to the best below it). */
static xxh3_stripes_fn xxh3_stripes_for(int isa)
{
#if PD_X86
    __builtin_cpu_init();
    if ((isa < 0 || isa >= 2) && __builtin_cpu_supports("avx512f"))
        return xxh3_stripes_avx512;
    if ((isa < 0 || isa >= 1) && __builtin_cpu_supports("avx2"))
        return xxh3_stripes_avx2;
#endif
    (void)isa;
    return xxh3_stripes_scalar;
}

/* Whether xxh3 hashes a record of this length by the long-input loop written out here: whole stripes (so that its
 * last stripe is its last 64 bytes), over 240 bytes (shorter inputs take other formulas). */
static int long_stripes(int64_t record_bytes)
{
    return record_bytes % STRIPE == 0 && record_bytes > 240;
}

/* The path pd_copy_hash_pieces and pd_hash_pieces take for this layout and isa: 0 portable, 1 AVX2, 2 AVX512,
 * -1 the xxhash package's streamed xxh3 (pieces that are not whole stripes, or records of 240 bytes or less). */
int pd_kv_copy_path(int64_t num_pieces, int64_t piece_bytes, int isa)
{
    if (piece_bytes % STRIPE || !long_stripes(num_pieces * piece_bytes))
        return -1;
    xxh3_stripes_fn fn = xxh3_stripes_for(isa);
#if PD_X86
    if (fn == xxh3_stripes_avx512)
        return 2;
    if (fn == xxh3_stripes_avx2)
        return 1;
#endif
    return 0;
}

static uint64_t mul128_fold64(uint64_t a, uint64_t b)
{
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t merge_accs(const uint64_t *acc, const uint8_t *key, uint64_t start)
{
    uint64_t h = start;
    for (int i = 0; i < 4; i++)
        h += mul128_fold64(acc[2 * i] ^ read64(key + 16 * i), acc[2 * i + 1] ^ read64(key + 16 * i + 8));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

static void store_be64(uint8_t *out, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        out[i] = (uint8_t)v;
}

/* XXH3_finalizeLong_128b, then XXH128_canonicalFromHash: high64 then low64, big-endian. */
static void xxh3_long_digest(const pd_xxh3_long *h, int64_t record_bytes, uint8_t *digest)
{
    uint64_t len = (uint64_t)record_bytes;
    store_be64(digest, merge_accs(h->acc, XXH3_SECRET + MERGE_HIGH_KEY, ~(len * XXH_P64_2)));
    store_be64(digest + 8, merge_accs(h->acc, XXH3_SECRET + MERGE_LOW_KEY, len * XXH_P64_1));
}

/* A block's place in fused_copy_hash's walk: its source base, and its index in the caller's order. */
typedef struct {
    int64_t base, index;
} pd_block_ref;

static int by_source_base(const void *a, const void *b)
{
    const pd_block_ref *x = a, *y = b;
    return x->base < y->base ? -1 : x->base > y->base;
}

/* A plane-by-plane walk (fused_copy_hash) that may be taken a few planes at a time: each block's xxh3 state, the
 * blocks in the order of their source bases, and the next piece to walk. pd_planes_new / _walk / _free
 * expose it: a prefill step hashes each layer's two pieces of its blocks right after writing them (engine.kv_digests),
 * while they are still in the caches. */
typedef struct {
    xxh3_stripes_fn stripes;
    int64_t num_blocks, num_pieces, piece_bytes, next_piece;
    pd_xxh3_long *h;       /* [num_blocks], 64-byte aligned */
    pd_block_ref *order;   /* [num_blocks], by source base */
} pd_planes;

static void planes_release(pd_planes *w)
{
    free(w->h);
    free(w->order);
}

/* Returns -1 when the per-block states cannot be allocated. */
static int planes_init(pd_planes *w, xxh3_stripes_fn stripes, const int64_t *src_bases, int64_t num_blocks,
                       int64_t num_pieces, int64_t piece_bytes)
{
    const size_t n = (size_t)(num_blocks > 0 ? num_blocks : 1);
    *w = (pd_planes){stripes, num_blocks, num_pieces, piece_bytes, 0, aligned_alloc(64, n * sizeof(pd_xxh3_long)),
                     malloc(n * sizeof(pd_block_ref))};
    if (!w->h || !w->order) {
        planes_release(w);
        return -1;
    }
    for (int64_t i = 0; i < num_blocks; i++) {
        xxh3_long_start(&w->h[i], num_pieces * piece_bytes);
        w->order[i].base = src_bases[i], w->order[i].index = i;
    }
    qsort(w->order, n, sizeof *w->order, by_source_base);
    return 0;
}

/* The walk's next `pieces` planes: piece p of every block (in source order) before piece p + 1. */
static void planes_walk(pd_planes *w, const uint8_t *src, int64_t src_stride, uint8_t *dst, const int64_t *dst_bases,
                        int64_t dst_stride, int64_t pieces)
{
    const int64_t nb = w->num_blocks, end = (w->next_piece + pieces) * nb;
    for (int64_t step = w->next_piece * nb; step < end; step++) {
        const int64_t p = step / nb;
        const pd_block_ref *block = &w->order[step % nb];
        if (step + PREFETCH_AHEAD < end) {
            const int64_t ahead = step + PREFETCH_AHEAD;
            prefetch_piece(src + w->order[ahead % nb].base + ahead / nb * src_stride, w->piece_bytes);
        }
        w->stripes(&w->h[block->index], src + block->base + p * src_stride,
                   dst ? dst + dst_bases[block->index] + p * dst_stride : NULL, w->piece_bytes / STRIPE, 0);
    }
    w->next_piece += pieces;
#if PD_X86
    if (dst)
        _mm_sfence();  /* the streamed stores are visible before the caller reads, or reports, the blocks */
#endif
}

/* copy_hash (below) on whole stripes: one pass a piece, xxh3 folded from the registers each stripe is stored from.
 * The walk goes plane by plane (every block's piece of layer 0 K, then of layer 0 V, ...), and within a plane in
 * the order of the source addresses, each block's xxh3 kept apart, so that a block's pieces still enter its hash
 * in record order. Pieces of one plane lie within one plane's bytes (the cache's blocks x piece_bytes) of each
 * other: the page walks hit the same page-table pages, and adjacent blocks are one sequential run. Measured on an
 * AMD EPYC (Zen 4), 12 KiB pieces of a 320-block cache, random block ids, against block by block
 * (bench/bench_kv_transfer.py, three runs alternated): hash in place 1.8x as fast at 256 blocks and 1.15x at 64,
 * copy + hash 1.5x and 1.07x. Returns -1 when the per-block states cannot be allocated. */
static int fused_copy_hash(xxh3_stripes_fn stripes, const uint8_t *src, const int64_t *src_bases, int64_t src_stride,
                           uint8_t *dst, const int64_t *dst_bases, int64_t dst_stride, int64_t num_blocks,
                           int64_t num_pieces, int64_t piece_bytes, uint8_t *digests)
{
    pd_planes w;
    if (planes_init(&w, stripes, src_bases, num_blocks, num_pieces, piece_bytes))
        return -1;
    planes_walk(&w, src, src_stride, dst, dst_bases, dst_stride, num_pieces);
    for (int64_t i = 0; i < num_blocks; i++)
        xxh3_long_digest(&w.h[i], num_pieces * piece_bytes, digests + 16 * i);
    planes_release(&w);
    return 0;
}

/* dst NULL: hash the source pieces where they are. Otherwise copy each piece and hash the bytes that landed (the
 * receiver must hash what landed, not what it read: kvstore.shm_cache): whole stripes in one pass (above), else
 * each piece copied, then hashed while it is still in L1/L2 with the package's xxh3. */
static int copy_hash(const uint8_t *src, const int64_t *src_bases, int64_t src_stride, uint8_t *dst,
                     const int64_t *dst_bases, int64_t dst_stride, int64_t num_blocks, int64_t num_pieces,
                     int64_t piece_bytes, uint8_t *digests, int isa)
{
    if (pd_kv_copy_path(num_pieces, piece_bytes, isa) >= 0)
        return fused_copy_hash(xxh3_stripes_for(isa), src, src_bases, src_stride, dst, dst_bases, dst_stride,
                               num_blocks, num_pieces, piece_bytes, digests);
    void *state = xxh3_create_state();
    if (!state)
        return -1;
    for (int64_t i = 0; i < num_blocks; i++) {
        xxh3_128_reset(state);
        for (int64_t p = 0; p < num_pieces; p++) {
            const uint8_t *landed = src + src_bases[i] + p * src_stride;
            if (dst) {
                uint8_t *to = dst + dst_bases[i] + p * dst_stride;
                memcpy(to, landed, (size_t)piece_bytes);
                landed = to;
            }
            int64_t ahead = p + PREFETCH_AHEAD, ahead_block = i + ahead / num_pieces;
            if (ahead_block < num_blocks)
                prefetch_piece(src + src_bases[ahead_block] + ahead % num_pieces * src_stride, piece_bytes);
            xxh3_128_update(state, landed, (size_t)piece_bytes);
        }
        xxh128_canonical_from_hash((pd_xxh128_canonical *)(digests + 16 * i), xxh3_128_digest(state));
    }
    xxh3_free_state(state);
    return 0;
}

/* Copy block i's pieces from src to dst and write the xxh3-128 canonical digest of what landed to digests[16 i].
 * isa: as pd_kv_copy_path. */
int pd_copy_hash_pieces(const uint8_t *src, const int64_t *src_bases, int64_t src_stride, uint8_t *dst,
                        const int64_t *dst_bases, int64_t dst_stride, int64_t num_blocks, int64_t num_pieces,
                        int64_t piece_bytes, uint8_t *digests, int isa)
{
    return copy_hash(src, src_bases, src_stride, dst, dst_bases, dst_stride, num_blocks, num_pieces, piece_bytes,
                     digests, isa);
}

/* The xxh3-128 canonical digest of block i's pieces, where they are, to digests[16 i]. isa: as pd_kv_copy_path. */
int pd_hash_pieces(const uint8_t *src, const int64_t *bases, int64_t stride, int64_t num_blocks, int64_t num_pieces,
                   int64_t piece_bytes, uint8_t *digests, int isa)
{
    return copy_hash(src, bases, stride, NULL, NULL, 0, num_blocks, num_pieces, piece_bytes, digests, isa);
}

/* The hash_pieces walk of blocks at `bases`, taken a few planes at a time (pd_planes above): NULL when the layout
 * does not take the one-pass loop (pd_kv_copy_path < 0) or out of memory. */
void *pd_planes_new(const int64_t *bases, int64_t num_blocks, int64_t num_pieces, int64_t piece_bytes, int isa)
{
    if (pd_kv_copy_path(num_pieces, piece_bytes, isa) < 0)
        return NULL;
    pd_planes *w = malloc(sizeof *w);
    if (w && planes_init(w, xxh3_stripes_for(isa), bases, num_blocks, num_pieces, piece_bytes)) {
        free(w);
        return NULL;
    }
    return w;
}

/* Hash planes next .. next + pieces - 1 of the blocks in src (piece p of block i at src + bases[i] + p * stride);
 * once the last is walked, each block's xxh3-128 canonical digest to digests[16 i]. Returns the planes walked so
 * far; -1 (nothing walked) when that would run past the record's last piece. */
int64_t pd_planes_walk(void *planes, const uint8_t *src, int64_t stride, int64_t pieces, uint8_t *digests)
{
    pd_planes *w = planes;
    if (pieces < 0 || pieces > w->num_pieces - w->next_piece)
        return -1;
    planes_walk(w, src, stride, NULL, NULL, 0, pieces);
    for (int64_t i = 0; w->next_piece == w->num_pieces && i < w->num_blocks; i++)
        xxh3_long_digest(&w->h[i], w->num_pieces * w->piece_bytes, digests + 16 * i);
    return w->next_piece;
}

void pd_planes_free(void *planes)
{
    if (planes) {
        planes_release(planes);
        free(planes);
    }
}

/* A payload of records streamed in order, in pieces of any length, between a contiguous run of its bytes and the
 * blocks' pieces where they are: the grpc transport's two ends (kvstore.paged_records). Records that are whole
 * stripes and longer than 240 bytes take the one-pass xxh3 (stretches cut anywhere: a stripe cut by a stretch's end
 * is copied, and kept in `carry` until the next stretch completes it); others the package's, stretch by stretch. */
typedef struct {
    pd_xxh3_long fused;           /* the one-pass xxh3 of the current record (first: 64-byte aligned) */
    uint8_t carry[STRIPE];        /* the current record's bytes of a stripe not yet whole */
    int64_t carry_len;
    xxh3_stripes_fn stripes;
    void *hash;                   /* the package's xxh3-128 of the current record's bytes so far */
    int64_t fed;                  /* payload bytes moved so far */
} pd_stream;

/* isa: as pd_kv_copy_path (the one-pass loop's ISA). */
void *pd_stream_new(int isa)
{
    pd_stream *stream = aligned_alloc(64, (sizeof(pd_stream) + 63) / 64 * 64);
    if (!stream)
        return NULL;
    memset(stream, 0, sizeof *stream);
    stream->stripes = xxh3_stripes_for(isa);
    stream->hash = xxh3_create_state();
    if (!stream->hash) {
        free(stream);
        return NULL;
    }
    xxh3_128_reset(stream->hash);
    return stream;
}

void pd_stream_free(void *stream)
{
    if (stream) {
        xxh3_free_state(((pd_stream *)stream)->hash);
        free(stream);
    }
}

/* n bytes src -> dst, folded into the current record's one-pass hash from what was written: a partial stripe at
 * either end goes through `carry`. */
static void stream_fused(pd_stream *stream, const uint8_t *src, uint8_t *dst, int64_t n, int keep_cached)
{
    if (stream->carry_len) {
        int64_t t = STRIPE - stream->carry_len < n ? STRIPE - stream->carry_len : n;
        memcpy(dst, src, (size_t)t);
        memcpy(stream->carry + stream->carry_len, dst, (size_t)t);
        stream->carry_len += t, src += t, dst += t, n -= t;
        if (stream->carry_len < STRIPE)
            return;
        stream->stripes(&stream->fused, stream->carry, NULL, 1, keep_cached);
        stream->carry_len = 0;
    }
    const int64_t whole = n / STRIPE, rest = n % STRIPE;
    if (whole)
        stream->stripes(&stream->fused, src, dst, whole, keep_cached);
    if (rest) {
        memcpy(dst + whole * STRIPE, src + whole * STRIPE, (size_t)rest);
        memcpy(stream->carry, dst + whole * STRIPE, (size_t)rest);
        stream->carry_len = rest;
    }
}

/* Move the payload's next `len` bytes: land != 0, from `run` into the blocks (record i's piece p at
 * blocks + bases[i] + p * stride); land == 0, from the blocks into `run`. Every stretch is hashed as it is written:
 * the digest of what landed. A record's last byte writes its canonical digest to digests[16 i] and starts the next
 * hash. `known` (NULL, or a flag per record): a gathered record flagged nonzero is only copied, its digest left to
 * the caller (one it already has). Returns the records complete so far; -1 when `len` runs past the num_records
 * records (nothing moved). */
int64_t pd_stream_move(void *stream_, uint8_t *run, int64_t len, int land, uint8_t *blocks, const int64_t *bases,
                       int64_t stride, int64_t num_records, int64_t num_pieces, int64_t piece_bytes,
                       const uint8_t *known, uint8_t *digests)
{
    pd_stream *stream = stream_;
    const int64_t record_bytes = num_pieces * piece_bytes;
    const int one_pass = long_stripes(record_bytes);
    if (len < 0 || len > num_records * record_bytes - stream->fed)
        return -1;
    for (int64_t pos = 0; pos < len;) {
        const int64_t record = stream->fed / record_bytes, within = stream->fed % record_bytes;
        const int64_t piece = within / piece_bytes, offset = within % piece_bytes;
        const int64_t n = piece_bytes - offset < len - pos ? piece_bytes - offset : len - pos;
        uint8_t *at = blocks + bases[record] + piece * stride + offset;
        uint8_t *written = land ? at : run + pos;
        const uint8_t *read = land ? run + pos : at;
        if (!land && offset == 0) {  /* reading scattered pieces: prefetched as copy_hash does */
            int64_t ahead = piece + PREFETCH_AHEAD, ahead_record = record + ahead / num_pieces;
            if (ahead_record < num_records)
                prefetch_piece(blocks + bases[ahead_record] + ahead % num_pieces * stride, piece_bytes);
        }
        const int copy_only = !land && known && known[record];
        if (copy_only) {
            memcpy(written, read, (size_t)n);
        } else if (one_pass) {
            if (within == 0)
                xxh3_long_start(&stream->fused, record_bytes);
            stream_fused(stream, read, written, n, !land);  /* a gathered message is read again soon: cached */
        } else {
            memcpy(written, read, (size_t)n);
            xxh3_128_update(stream->hash, written, (size_t)n);
        }
        pos += n;
        stream->fed += n;
        if (stream->fed % record_bytes == 0 && !copy_only) {
            if (one_pass) {
                xxh3_long_digest(&stream->fused, record_bytes, digests + 16 * record);
            } else {
                xxh128_canonical_from_hash((pd_xxh128_canonical *)(digests + 16 * record),
                                           xxh3_128_digest(stream->hash));
                xxh3_128_reset(stream->hash);
            }
        }
    }
#if PD_X86
    if (land && one_pass)
        _mm_sfence();  /* the streamed stores are visible before the caller reports the blocks */
#endif
    return stream->fed / record_bytes;
}
